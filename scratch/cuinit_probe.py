"""Which import initialises CUDA's driver in a launcher (NVML checks on)? Prints each module with the driver state,
and the stack of the first call into CUDA."""
import importlib, os, sys, traceback
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
from llamafactory_mca.launch.torchrun import cuda_driver_untouched as u
import torch
seen = []
def report(name, real):
    def f(*a, **k):
        stack = [fr for fr in traceback.extract_stack()[:-1] if "importlib" not in fr.filename]
        where = [f"{fr.filename.split('site-packages/')[-1]}:{fr.lineno}" for fr in stack[-6:]]
        if where[-3:] not in seen and len(seen) < 6:
            seen.append(where[-3:])
            print(f"CUDA CALL {name}: " + " <- ".join(reversed(where)), flush=True)
        return real(*a, **k)
    return f
torch._C._cuda_getDeviceCount = report("_cuda_getDeviceCount", torch._C._cuda_getDeviceCount)
torch.cuda._lazy_init = report("_lazy_init", torch.cuda._lazy_init)
print("start", u(), flush=True)
for m in ["transformers", "datasets", "peft", "trl", "llamafactory.extras.misc", "llamafactory.hparams",
          "llamafactory.train.tuner", "megatron.core", "llamafactory_mca.workflow", "llamafactory_mca.trainer.trainer",
          "llamafactory_mca.models.auto", "torch.distributed.run"]:
    importlib.import_module(m)
    print(m, u(), flush=True)
