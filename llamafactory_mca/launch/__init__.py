"""Before any worker starts: the command line, the USE_MCA=1 hook into LLaMA-Factory, the launcher's checks and
our torchrun."""
