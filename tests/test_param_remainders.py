"""``store_param_remainders``: fp32 master weights kept as bf16 weights plus 16-bit remainders.

The optimizer alone (fast): the masters it rebuilds are bit for bit those of torch's AdamW on fp32 masters, step
after step, with chunk boundaries inside tensors; its state survives Megatron's checkpoint calls and torch's
``load_state_dict``. Through the real command (slow, bf16 on CPU processes): the first step equals the plain path's,
the rest follow it; a checkpoint resumes in either mode, under another layout too.
"""

import pytest
import torch

from llamafactory_mca.trainer import param_remainders
from llamafactory_mca.trainer.param_remainders import RemainderAdamW, join, split
from tests._cli import losses, ok, one_error, recipe, train


def _half_away(master: torch.Tensor) -> torch.Tensor:
    """bf16 rounding half away from zero, by value (the reference the bit arithmetic must equal)."""
    down = master.to(torch.bfloat16)
    bits = master.view(torch.int32) & 0xFFFF
    tie = bits == 0x8000
    truncated = (master.view(torch.int32) & ~0xFFFF).view(torch.float32)
    away = (truncated.view(torch.int32) + 0x10000).view(torch.float32).to(torch.bfloat16)
    return torch.where(tie, away, down)


def test_split_and_join_round_trip_every_value_kind():
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(100_000, generator=gen) * 10 ** torch.randint(-30, 30, (100_000,), generator=gen),
                        torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1.0, -1.0])])
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x407F8000, -0x407E8000], dtype=torch.int32).view(torch.float32)
    values = torch.cat([values, ties])
    low, rest = torch.empty_like(values, dtype=torch.bfloat16), torch.empty_like(values, dtype=torch.int16)
    split(values, low, rest)
    assert torch.equal(join(low, rest).view(torch.int32), values.view(torch.int32))
    assert torch.equal(low.view(torch.int16), _half_away(values).view(torch.int16))
    differs = low.view(torch.int16) != values.to(torch.bfloat16).view(torch.int16)  # torch's cast: ties to even
    assert bool(((values.view(torch.int32) & 0xFFFF)[differs] == 0x8000).all())
    assert differs[-4:].tolist() == [True, False, True, False]  # an even upper half: torch keeps it, we round away


def _pair(adam_w_mode: bool):
    gen = torch.Generator().manual_seed(1)
    masters = [torch.randn(n, generator=gen) for n in (1000, 37, 4096)]
    masters[:2] = [m.to(torch.bfloat16).float() for m in masters[:2]]  # Megatron's masters start as the bf16 weights
    reference = [torch.nn.Parameter(m.clone()) for m in masters]
    ours = [m.to(torch.bfloat16) for m in masters[:2]] + [masters[2].clone()]  # the last one fp32
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = cls([{"params": reference[:2]}, {"params": reference[2:], "weight_decay": 0.0}], **kwargs)
    opt = RemainderAdamW([{"params": ours[:2]}, {"params": ours[2:], "weight_decay": 0.0}], adam_w_mode=adam_w_mode,
                         **kwargs)
    for p in ours:
        opt.initialize_state(p)
    return reference, ref_opt, ours, opt, gen


def _step(reference, ref_opt, ours, opt, gen):
    for ref, p in zip(reference, ours):
        g = torch.randn(ref.shape, generator=gen)
        ref.grad, p.decoupled_grad = g.clone(), g.clone()
    ref_opt.step()
    opt.step()


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_masters_are_torchs_adam_on_fp32_masters_bit_for_bit(monkeypatch, adam_w_mode):
    monkeypatch.setattr(param_remainders, "CHUNK", 300)  # chunk boundaries inside every tensor
    reference, ref_opt, ours, opt, gen = _pair(adam_w_mode)
    for _ in range(4):
        _step(reference, ref_opt, ours, opt, gen)
        for ref, p in zip(reference, ours):
            master = opt.get_unscaled_state(p, "master_param")
            assert torch.equal(master.view(torch.int32), ref.detach().view(torch.int32))
            if p.dtype == torch.bfloat16:
                assert torch.equal(p.view(torch.int16), _half_away(ref.detach()).view(torch.int16))
        for ref, p in zip(reference, ours):
            assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[ref]["exp_avg"])
    assert [float(opt.state[p]["step"]) for p in ours] == [4.0] * 3
    assert opt.state[ours[0]]["master_param"].dtype == torch.int16 and opt.state[ours[2]]["master_param"].numel() == 0


def test_bf16_moments_follow_fp32_adam_and_save_widened(monkeypatch):
    """``exp_avg_dtype: bf16`` and ``exp_avg_sq_dtype: bf16``: the moments are kept as bf16 (rounded to nearest-even
    from the fp32 step), the masters follow fp32 Adam closely, and a checkpoint holds fp32 moments either way: one
    saved with bf16 moments resumes into fp32 moments and back."""
    monkeypatch.setattr(param_remainders, "CHUNK", 300)
    reference, ref_opt, _, _, gen = _pair(True)
    ours = [p.detach().to(torch.bfloat16) for p in reference[:2]]
    opt = RemainderAdamW(ours, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                         exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    ref_opt = torch.optim.AdamW(reference[:2], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for p in ours:
        opt.initialize_state(p)
    for _ in range(4):
        _step(reference[:2], ref_opt, ours, opt, gen)
    for ref, p in zip(reference, ours):
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        master = opt.get_unscaled_state(p, "master_param")
        assert (master - ref.detach()).abs().max() < 1e-3 * ref.detach().abs().max()
        assert not torch.equal(master, ref.detach())  # the moments' rounding shows
        saved = opt.get_unscaled_state(p, "exp_avg")
        assert saved.dtype == torch.float32 and torch.equal(saved, state["exp_avg"].float())
    # one step of the chunked path, by hand: widened moments, torch's Adam, rounded back
    g = torch.randn(ours[0].shape, generator=gen)
    master = opt.get_unscaled_state(ours[0], "master_param")
    moments = [opt.state[ours[0]][k].float() for k in ("exp_avg", "exp_avg_sq")]
    by_hand = torch.optim.AdamW([torch.nn.Parameter(master)], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    by_hand.state[by_hand.param_groups[0]["params"][0]] = dict(step=torch.tensor(4.0), exp_avg=moments[0],
                                                               exp_avg_sq=moments[1])
    by_hand.param_groups[0]["params"][0].grad = g.clone()
    by_hand.step()
    for p in ours:
        p.decoupled_grad = g.clone() if p is ours[0] else torch.zeros_like(p, dtype=torch.float32)
    opt.step()
    assert torch.equal(opt.get_unscaled_state(ours[0], "master_param"), by_hand.param_groups[0]["params"][0].detach())
    assert torch.equal(opt.state[ours[0]]["exp_avg"], moments[0].to(torch.bfloat16))
    # fp32 moments take a bf16-moment checkpoint; bf16 moments take an fp32 one
    wide = RemainderAdamW([torch.zeros_like(ours[0])], lr=1e-2)
    narrow = RemainderAdamW([torch.zeros_like(ours[0])], lr=1e-2, exp_avg_dtype=torch.bfloat16,
                            exp_avg_sq_dtype=torch.bfloat16)
    for other in (wide, narrow):
        q = other.param_groups[0]["params"][0]
        other.initialize_state(q)
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            other.set_scaled_state(q, key, opt.get_unscaled_state(ours[0], key))
        assert torch.equal(q, ours[0])
        assert other.state[q]["exp_avg"].dtype == other.moment_dtypes["exp_avg"]
        assert torch.equal(other.get_unscaled_state(q, "exp_avg"), opt.get_unscaled_state(ours[0], "exp_avg"))
    with pytest.raises(ValueError, match="exp_avg_dtype=torch.float16"):
        RemainderAdamW(ours, exp_avg_dtype=torch.float16)


def test_state_moves_through_checkpoint_calls_and_load_state_dict():
    reference, ref_opt, ours, opt, gen = _pair(True)
    for _ in range(2):
        _step(reference, ref_opt, ours, opt, gen)
    saved = {p: {k: opt.get_unscaled_state(p, k).clone() for k in opt.state[p]} for p in ours}
    assert all(v["master_param"].dtype == torch.float32 for v in saved.values())

    fresh = [torch.zeros_like(p) for p in ours]  # another run's parameters: the master sets them
    other = RemainderAdamW([{"params": fresh[:2]}, {"params": fresh[2:], "weight_decay": 0.0}], lr=1e-2,
                           betas=(0.9, 0.95), weight_decay=0.1)
    for p in fresh:
        other.initialize_state(p)
    other.load_state_dict(other.state_dict())  # torch would cast the fp32 moments to bf16: they stay fp32
    assert other.state[fresh[0]]["exp_avg"].dtype == torch.float32
    assert other.state[fresh[0]]["master_param"].dtype == torch.int16
    for p, q in zip(ours, fresh):
        for key, value in saved[p].items():
            other.set_scaled_state(q, key, value)
        other.set_scaled_state(q, "padding", False)  # Megatron hands over a bucket entry's flag too
        assert torch.equal(q.view(-1), p.view(-1))
    for _ in range(2):  # both continue alike
        g = [torch.randn(p.shape, generator=gen) for p in ours]
        for p, q, grad in zip(ours, fresh, g):
            p.decoupled_grad, q.decoupled_grad = grad.clone(), grad.clone()
        opt.step()
        other.step()
    for p, q in zip(ours, fresh):
        assert torch.equal(opt.get_unscaled_state(p, "master_param"), other.get_unscaled_state(q, "master_param"))
        assert float(other.state[q]["step"]) == 4.0


# ---- through the real command --------------------------------------------------------------------------------------

BF16 = dict(bf16=True, use_distributed_optimizer=True, max_steps=4)


@pytest.fixture(scope="module")
def pair(assets, tmp_path_factory):
    """The plain path, ours and ours with bf16 moments, 4 steps each, a checkpoint at step 2."""
    tmp_path = tmp_path_factory.mktemp("remainders")
    runs = {}
    for name, extra in (("plain", {}), ("remainders", {"store_param_remainders": True}),
                        ("moments", {"store_param_remainders": True, "exp_avg_dtype": "bf16",
                                     "exp_avg_sq_dtype": "bf16"})):
        result, output = train(tmp_path, recipe(assets, tmp_path / name, save_strategy="steps", save_steps=2,
                                                **BF16, **extra), name=name)
        ok(result, output)
        runs[name] = output
    return tmp_path, runs


@pytest.mark.slow
def test_training_follows_the_plain_path(pair):
    tmp_path, runs = pair
    plain, ours = losses(tmp_path / "plain"), losses(tmp_path / "remainders")
    assert ours[1] == plain[1]
    for step in (2, 3, 4):
        assert ours[step] == pytest.approx(plain[step], rel=1e-4)
    assert "fp32 masters as bf16 + 16-bit remainders" in runs["remainders"]
    assert "fp32 masters as bf16 + 16-bit remainders" not in runs["plain"]
    moments = losses(tmp_path / "moments")  # bf16 moments: the first step is the same, the rest close
    assert moments[1] == plain[1]
    for step in (2, 3, 4):
        assert moments[step] == pytest.approx(plain[step], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("source, world, extra, exact", [
    ("remainders", 1, {"store_param_remainders": True}, "remainders"),  # as saved: the same steps, bit for bit
    ("plain", 1, {"store_param_remainders": True}, None),  # the first step after the resume is the plain one's
    ("plain", 2, {"store_param_remainders": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16",
                  "gradient_accumulation_steps": 2}, None),  # and DP2, the moments sharded in bf16
    ("remainders", 2, {"tensor_model_parallel_size": 2}, None),  # back to the plain path, under TP2
    # Adam's moments rounded to bf16 on load and kept so (the checkpoint holds them in fp32)
    ("remainders", 1, {"store_param_remainders": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}, None),
    ("moments", 2, {"gradient_accumulation_steps": 2}, None),  # and widened again, at DP2 on the plain path
])
def test_checkpoints_resume_in_either_mode_and_layout(assets, pair, tmp_path, source, world, extra, exact):
    runs_dir, _ = pair
    name = f"from-{source}-{world}"
    config = recipe(assets, tmp_path / name, resume_from_checkpoint=str(runs_dir / source / "checkpoint-2"),
                    **{**BF16, **extra})
    result, output = train(tmp_path, config, world=world, name=name)
    ok(result, output)
    got, reference = losses(tmp_path / name), losses(runs_dir / source)
    if exact:
        assert got == {3: reference[3], 4: reference[4]}
    else:
        for step in (3, 4):
            assert got[step] == pytest.approx(reference[step], rel=1e-3)
    if source == "plain" and world == 1:
        assert got[3] == reference[3]
    assert ("moments exp_avg bf16 and exp_avg_sq bf16" in output) == ("exp_avg_dtype" in extra)


@pytest.mark.parametrize("extra, words", [
    ({"store_param_remainders": True, "use_distributed_optimizer": True},
     ["store_param_remainders=True", "not bf16", "bf16: true"]),
    ({"store_param_remainders": True, "bf16": True, "use_distributed_optimizer": False},
     ["store_param_remainders=True", "use_distributed_optimizer=True", "use_distributed_optimizer: true"]),
    ({"exp_avg_dtype": "bf16", "bf16": True}, ["exp_avg_dtype=bf16", "store_param_remainders: true"]),
    ({"exp_avg_sq_dtype": "fp16", "store_param_remainders": True, "bf16": True, "use_distributed_optimizer": True},
     ["exp_avg_sq_dtype='fp16'", "fp32, bf16"]),
])
def test_refusals_are_one_line_before_any_worker(assets, tmp_path, extra, words):
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", **extra), alone=False)
    one_error(result, output, *words)
    assert not (tmp_path / "out").exists()
