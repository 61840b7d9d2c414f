"""The Dockerfile keeps its base image's torch. No Docker engine runs here, so this reads its install lines.

An NGC image's torch is built with its Transformer Engine and flash-attn; a pip command that may resolve torch
(``pip install -e .`` with this package's pins, ``pip install -r`` of packages that ask for torch) can replace it
with a wheel from the index. So every pip install must either take no dependencies (``--no-deps``) or run under a
constraints file that names the image's installed torch builds.
"""

import os
import re
import shlex


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_SET = ("torch", "torchvision", "torchaudio")


def run_commands(text: str) -> list[list[str]]:
    """Every shell command of every RUN instruction, as words: continuation lines joined, quotes respected, split at
    && || | ; and parentheses (a redirection ``> FILE`` stays in its command)."""
    text = re.sub(r"\\\n", " ", text)
    commands = []
    for line in text.splitlines():
        if not line.startswith("RUN "):
            continue
        lexer = shlex.shlex(line[4:], posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command = []
        for token in lexer:
            if token in ("&&", "||", "|", ";", "(", ")"):
                commands.append(command)
                command = []
            else:
                command.append(token)
        commands.append(command)
    return [c for c in commands if c]


def pip_installs(commands: list[list[str]]) -> list[list[str]]:
    found = []
    for words in commands:
        if words[:2] == ["pip", "install"]:
            found.append(words[2:])
        elif words[1:4] == ["-m", "pip", "install"]:
            found.append(words[4:])
    return found


def check(text: str) -> list[str]:
    """What in a Dockerfile could replace the image's torch, one line each."""
    commands = run_commands(text)
    problems = []
    constraint_files = set()
    for i, words in enumerate(commands):
        # a constraints file written from what is installed: `pip list --format=freeze | grep torch... > FILE`
        if words[:2] in (["pip", "list"], ["pip", "freeze"]):
            following = commands[i + 1] if i + 1 < len(commands) else []
            if following[:1] == ["grep"] and ">" in following and all(n in " ".join(following) for n in TORCH_SET):
                constraint_files.add(following[following.index(">") + 1])
    for args in pip_installs(commands):
        if "--no-deps" in args:
            continue
        constraints = {args[j + 1] for j, a in enumerate(args[:-1]) if a in ("-c", "--constraint")}
        if not constraints & constraint_files:
            problems.append(f"pip install {' '.join(args)}: resolves dependencies without a constraints file naming "
                            "the image's torch, torchvision and torchaudio")
        targets = [a for a in args if not a.startswith("-")]
        if "." in targets or any(a in ("requirements/torch.txt",) for a in args):
            problems.append(f"pip install {' '.join(args)}: installs this package's own torch pins")
    return problems


def test_the_dockerfile_never_lets_pip_replace_the_images_torch():
    with open(os.path.join(ROOT, "Dockerfile"), encoding="utf-8") as f:
        text = f.read()
    assert check(text) == []
    installs = pip_installs(run_commands(text))
    assert any("-e" in args and "." in args and "--no-deps" in args for args in installs), installs
    assert any("requirements/stack.txt" in args for args in installs), installs
    words = [w for command in run_commands(text) for w in command]
    assert "llamafactory-mca" in words and "version" in words  # the build fails if the set does not load


def test_the_stack_file_names_no_torch_package():
    """``pip install -r requirements/stack.txt`` must not ask for a torch of its own (it lives in torch.txt)."""
    with open(os.path.join(ROOT, "requirements", "stack.txt"), encoding="utf-8") as f:
        names = [re.split(r"[=<>!~\[; ]", line.strip())[0].lower() for line in f
                 if line.strip() and not line.startswith("#")]
    assert not set(names) & set(TORCH_SET), names


def test_the_check_catches_what_would_replace_torch():
    base = "FROM nvcr.io/nvidia/pytorch:25.10-py3\nCOPY . .\n"
    assert check(base + "RUN pip install --no-cache-dir -e . \\\n    && llamafactory-mca version\n")
    assert check(base + "RUN pip install .\n")
    assert check(base + "RUN pip install -r requirements/stack.txt && pip install --no-deps -e .\n")
    assert check(base + "RUN pip install -c /tmp/other.txt -r requirements/stack.txt\n")
    assert check(base + "RUN pip install --no-deps -e . && python -m pip install transformers\n")
    kept = ("RUN pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio)==' > /tmp/t.txt \\\n"
            "    && pip install -c /tmp/t.txt -r requirements/stack.txt && pip install --no-deps -e .\n")
    assert check(base + kept) == []
