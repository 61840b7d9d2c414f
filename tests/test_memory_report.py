"""The peak-memory report's replay: which allocations are alive at the allocator's peak, grouped by origin."""

from llamafactory_mca.memory_report import live_at_peak, report


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


PARAMS = [_frame("/x/torch/nn/modules/module.py", 1, "to"), _frame("/site/megatron/core/layers.py", 10, "init")]
GRADS = [_frame("/site/megatron/core/distributed/buffer.py", 20, "alloc_grad")]
ACT = [_frame("/repo/llamafactory_mca/models/native/experts.py", 30, "forward")]
TMP = [_frame("/lib/torch/optim/adam.py", 40, "_multi_tensor_adam")]


def _trace() -> list[dict]:
    return [
        {"action": "alloc", "addr": 1, "size": 100, "frames": PARAMS},
        {"action": "alloc", "addr": 2, "size": 200, "frames": GRADS},
        {"action": "alloc", "addr": 3, "size": 50, "frames": ACT},  # 350 alive
        {"action": "free_requested", "addr": 3, "size": 50},
        {"action": "free_completed", "addr": 3, "size": 50},  # 300
        {"action": "alloc", "addr": 4, "size": 120, "frames": TMP},  # 420: the peak
        {"action": "alloc", "addr": 5, "size": 30, "frames": []},  # 450: higher
        {"action": "free_completed", "addr": 4, "size": 120},
        {"action": "free_completed", "addr": 5, "size": 30},  # 300
        {"action": "alloc", "addr": 6, "size": 10, "frames": ACT},
    ]


def test_replay_finds_the_peak_and_what_is_alive_then():
    peak, live = live_at_peak(_trace())
    assert peak == 450
    assert sorted(e["addr"] for e in live) == [1, 2, 4, 5]


def test_report_groups_by_the_innermost_line_of_interest():
    text = report(_trace(), step=2)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows[0].startswith("| `megatron/core/distributed/buffer.py:20 alloc_grad`")
    assert any("torch/optim/adam.py:40 _multi_tensor_adam" in r for r in rows)
    assert any("megatron/core/layers.py:10 init" in r for r in rows)  # not torch's module.py: not of interest
    assert any("(elsewhere)" in r for r in rows)
    assert not any("experts.py" in r for r in rows)  # freed before the peak
