"""LowPrecisionOptimizer: stored weights on the grid, SR reproducibility, selection, state,
Kahan compensation, schedulers and state-dict round trips."""

import copy

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer, select_params

# CI runs these once more at torch's default thread count: the optimizer's packed steps and torch's
# foreach kernels split their work by thread.
pytestmark = pytest.mark.threads


def on_grid(t, fmt):
    return torch.equal(lp.quantize(t, fmt), t)


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def step_once(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g)
    y = torch.randn(32, 1, generator=g)
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("fmt", ["bf16", "e4m3", "e5m3", "fp16"])
def test_nearest_equals_rounded_fp32_step(fmt):
    model = small_model()
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), fmt)
    for p in model.parameters():
        assert on_grid(p.detach(), fmt)  # rounded at construction
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    for s in range(5):
        step_once(model, opt, s)
        step_once(twin, twin_opt, s)
        with torch.no_grad():
            for p in twin.parameters():
                p.copy_(lp.quantize(p, fmt))
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
            assert on_grid(p.detach(), fmt)


def test_tiny_update_freezes_under_nearest_and_moves_under_sr():
    w = torch.nn.Parameter(torch.ones(10_000))
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "bf16")
    w.grad = torch.ones_like(w)
    opt.step()
    assert torch.all(w == 1.0)  # 1e-3 < ulp(1)/4 = 2**-9 below a power of two
    w2 = torch.nn.Parameter(torch.ones(10_000))
    opt2 = LowPrecisionOptimizer(torch.optim.SGD([w2], lr=1e-3), "bf16", rounding="stochastic",
                                 generator=torch.Generator().manual_seed(0))
    w2.grad = torch.ones_like(w2)
    opt2.step()
    moved = (w2 != 1.0).float().mean().item()
    # below 1.0 the gap is 2**-8: P(move) = 1e-3 / 2**-8 = 0.256
    assert abs(moved - 1e-3 / 2**-8) < 0.02
    assert abs(w2.mean().item() - (1 - 1e-3)) < 2e-5  # unbiased


def test_sr_reproducible_from_generator_and_seed():
    def run(seed):
        model = small_model()
        opt = LowPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), "e5m2", rounding="stochastic",
                                    generator=torch.Generator().manual_seed(seed))
        for s in range(3):
            step_once(model, opt, s)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


def test_int_seed_generator_is_reproducible():
    a = lp.quantize(torch.linspace(0, 1, 1000), "e4m3", "stochastic", generator=7)
    b = lp.quantize(torch.linspace(0, 1, 1000), "e4m3", "stochastic", generator=7)
    assert torch.equal(a, b)


def test_int_seed_in_the_optimizer_draws_fresh_bits_every_step():
    """An int seed seeds one generator for the run: step after step the random bits differ (the
    same bits every step would correlate the roundings), and the run is reproducible."""
    def run(seed, steps):
        w = torch.nn.Parameter(torch.ones(4096))
        opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "bf16", rounding="stochastic", generator=seed)
        moved = []
        for _ in range(steps):
            before = w.detach().clone()
            w.grad = torch.ones_like(w)
            opt.step()
            moved.append(w.detach() != before)
        return w.detach().clone(), moved

    w_a, moved = run(5, 2)
    w_b, _ = run(5, 2)
    assert torch.equal(w_a, w_b)
    # with P(move) about 0.26 per step, the same bits would move the very same elements twice
    assert not torch.equal(moved[0], moved[1])
    assert abs(moved[1].float().mean().item() - 1e-3 / 2**-8) < 0.03
    with pytest.raises(TypeError, match="torch.Generator, an int seed or None"):
        LowPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1e-3), "bf16",
                              rounding="stochastic", generator="7")


def test_matrices_only_selection():
    model = small_model()
    biases_before = [m.bias.detach().clone() for m in model if isinstance(m, torch.nn.Linear)]
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), "e4m3", params="matrices")
    assert all(p.dim() == 2 for p in opt.lowprec_params) and len(opt.lowprec_params) == 2
    for b, m in zip(biases_before, [m for m in model if isinstance(m, torch.nn.Linear)]):
        assert torch.equal(b, m.bias.detach())  # not rounded at construction
    step_once(model, opt)
    lins = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert all(on_grid(m.weight.detach(), "e4m3") for m in lins)
    assert not all(on_grid(m.bias.detach(), "e4m3") for m in lins)


def test_select_params_errors_and_predicates():
    params = list(small_model().parameters())
    assert len(select_params(params, lambda p: p.dim() == 1)) == 2
    assert len(select_params(params, params[:1])) == 1
    with pytest.raises(ValueError, match="all, matrices"):
        select_params(params, "vectors")


def test_state_format_keeps_adam_moments_on_grid():
    model = small_model()
    opt = LowPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), "bf16", state_format="bf16")
    for s in range(3):
        step_once(model, opt, s)
    for p in model.parameters():
        st = opt.state[p]
        assert on_grid(st["exp_avg"], "bf16") and on_grid(st["exp_avg_sq"], "bf16")


def test_bf16_second_moment_cannot_decay():
    # science.md: 0.999 v rounds back to v in bf16 under RNE, since 1 - 0.999 < 2**-9
    v = torch.tensor([1.0, 0.75, 3e-5, 1.7])
    v = lp.quantize(v, "bf16")
    assert torch.equal(lp.quantize(0.999 * v, "bf16"), v)
    assert lp.would_freeze(v, -0.001 * v, "bf16").all()


def test_kahan_recovers_lost_updates():
    def run(**kw):
        w = torch.nn.Parameter(torch.ones(4))
        opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "bf16", **kw)
        for _ in range(200):
            w.grad = torch.ones_like(w)
            opt.step()
        return w.detach()

    nearest, kahan = run(), run(compensation="kahan")
    assert torch.all(nearest == 1.0)
    exact = 1 - 200 * 1e-3
    assert torch.all((kahan - exact).abs() <= lp.ulp(torch.tensor(exact), "bf16"))
    assert on_grid(kahan, "bf16")


def test_kahan_on_a_strided_parameter_is_kahan_on_a_contiguous_one():
    # each weight and its buffer compensated in place: a strided weight takes the same steps to the
    # same bits as a contiguous one, with either buffer
    torch.manual_seed(0)
    values = [torch.randn(5, 3), torch.randn(7), torch.randn(3, 4)]
    grads = [[torch.randn_like(v) * 10.0 ** -k for v in values] for k in range(2, 6) for _ in range(5)]

    def run(strided, buffer):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        if strided:
            params[2] = torch.nn.Parameter(values[2].t().contiguous().t())
            assert not params[2].is_contiguous()
        opt = LowPrecisionOptimizer(torch.optim.SGD(params, lr=0.1), "bf16", compensation="kahan",
                                    compensation_format=buffer)
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        buffers = opt.state_dict()["lowprec"]["compensation_buffers"]
        return [p.detach().view(torch.int32).clone() for p in params] + [buffers[i].view(torch.int32) for i in range(3)]

    for buffer in (None, "bf16"):
        flat, by_tensor = run(False, buffer), run(True, buffer)
        assert all(torch.equal(a, b) for a, b in zip(flat, by_tensor)), buffer
        assert any(b.any() for b in flat[3:])       # the buffers hold residuals


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def _rounded_sgd_run(model, steps, opt=None):
    """``steps`` SGD steps on ``model``: through ``opt`` (a LowPrecisionOptimizer), or plain SGD
    then every parameter rounded to bf16 with quantize (the reference, no packs)."""
    inner = opt or torch.optim.SGD(model.parameters(), lr=0.3)
    if opt is None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(lp.quantize(p, "bf16"))
    for s in steps:
        step_once(model, inner, s)
        if opt is None:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(lp.quantize(p, "bf16"))


def test_parameters_keep_their_storage_unless_packing_is_asked():
    # by default every parameter is rounded where it lies; the weights are those of rounding each alone
    model, reference = small_model(), small_model()
    params = list(model.parameters())
    home = _storages(params)
    opt = LowPrecisionOptimizer(torch.optim.SGD(params, lr=0.3), "bf16")
    _rounded_sgd_run(model, range(4), opt)
    _rounded_sgd_run(reference, range(4))
    assert _storages(params) == home and len(home) == 4 and opt.held_bytes() == 0 and not opt.packs.kept
    assert all(torch.equal(p.view(torch.int32), q.view(torch.int32)) for p, q in zip(params, reference.parameters()))


def test_small_parameters_live_in_their_pack_with_the_same_bits():
    # with pack=True the small tensors are rounded in one pack, whose buffer they live in from the
    # start: a step copies nothing in or out, and the weights are those of rounding each tensor alone
    model, reference = small_model(), small_model()
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.3), "bf16", pack=True)
    params = list(model.parameters())
    home = _storages(params)
    assert len(home) == 1 and opt.held_bytes() == 0      # one buffer, and it is theirs
    assert "pack=True" in repr(opt)
    _rounded_sgd_run(model, range(4), opt)
    _rounded_sgd_run(reference, range(4))
    assert _storages(params) == home
    assert all(torch.equal(p.view(torch.int32), q.view(torch.int32)) for p, q in zip(params, reference.parameters()))
    # a parameter given new storage is copied in and lives there again; the values are kept
    with torch.no_grad():
        params[0].data = params[0].data.clone()
    assert len(_storages(params)) == 2
    _rounded_sgd_run(model, range(4, 6), opt)
    _rounded_sgd_run(reference, range(4, 6))
    assert len(_storages(params)) == 1
    assert all(torch.equal(p.view(torch.int32), q.view(torch.int32)) for p, q in zip(params, reference.parameters()))


def test_parameters_sharing_memory_are_not_moved():
    # asked to pack, two parameters that are views of one tensor stay views of it (moving them into a
    # pack would part them): their values are copied in and back, and rounded all the same
    base = torch.randn(12)
    a, b = torch.nn.Parameter(base[:5]), torch.nn.Parameter(base[5:])
    opt = LowPrecisionOptimizer(torch.optim.SGD([a, b], lr=1e-2), "bf16", pack=True)
    assert a.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert torch.equal(base, lp.quantize(base, "bf16"))
    a.grad, b.grad = torch.ones(5), torch.ones(7)
    opt.step()
    assert torch.equal(base[:5], a.detach()) and torch.equal(base, lp.quantize(base, "bf16"))
    assert opt.held_bytes() == 12 * 4    # the pack's buffer is its own memory here


def test_kahan_compensates_in_place_and_holds_its_buffers_only():
    # Kahan keeps no work tensors: each weight stays where it lies, each buffer is a tensor of its
    # own, and the wrapper holds the buffers and nothing more
    model = small_model()
    params = list(model.parameters())
    home = _storages(params)
    opt = LowPrecisionOptimizer(torch.optim.SGD(params, lr=1e-4), "bf16", compensation="kahan")
    for s in range(3):
        step_once(model, opt, s)
    buffers = [opt._compensation_buffers[p] for p in params]
    assert _storages(params) == home and len(_storages(buffers)) == len(params)
    assert opt.held_bytes() == sum(p.numel() * 4 for p in params)
    assert any(b.any() for b in buffers)


def test_lr_scheduler_and_zero_grad():
    model = small_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = LowPrecisionOptimizer(inner, "bf16")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step_once(model, opt)
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.param_groups is inner.param_groups
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_state_dict_round_trip_continues_identically():
    def make():
        model = small_model()
        opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "e5m2", rounding="stochastic",
                                    generator=torch.Generator().manual_seed(3))
        return model, opt

    model, opt = make()
    for s in range(3):
        step_once(model, opt, s)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    for s in range(3, 6):
        step_once(model, opt, s)
    model2, opt2 = make()
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    for s in range(3, 6):
        step_once(model2, opt2, s)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_kahan_buffers_survive_state_dict():
    w = torch.nn.Parameter(torch.ones(3))
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "bf16", compensation="kahan")
    w.grad = torch.ones(3)
    opt.step()
    sd = opt.state_dict()
    assert sd["lowprec"]["compensation_buffers"][0].abs().sum() > 0
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = LowPrecisionOptimizer(torch.optim.SGD([w2], lr=1e-3), "bf16", compensation="kahan")
    opt2.load_state_dict(sd)
    assert torch.equal(opt2._compensation_buffers[w2], opt._compensation_buffers[w])
    with pytest.raises(ValueError, match="saved for format bf16"):
        LowPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1e-3), "fp16").load_state_dict(sd)


def test_bad_arguments_name_allowed_values():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        LowPrecisionOptimizer(object(), "bf16")
    with pytest.raises(ValueError, match="nearest, stochastic"):
        LowPrecisionOptimizer(torch.optim.SGD(p, lr=1), "bf16", rounding="up")
    with pytest.raises(ValueError, match="kahan"):
        LowPrecisionOptimizer(torch.optim.SGD(p, lr=1), "bf16", compensation="pairwise")
    with pytest.raises(ValueError, match="valid names"):
        LowPrecisionOptimizer(torch.optim.SGD(p, lr=1), "bf17")
    with pytest.raises(ValueError, match="saturate"):
        LowPrecisionOptimizer(torch.optim.SGD(p, lr=1), "e4m3", overflow="inf")


def test_step_hooks_run_around_the_whole_step():
    w = torch.nn.Parameter(torch.ones(3))
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "bf16")
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", w.tolist())))
    handle = opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", w.tolist())))
    w.grad = torch.full((3,), 0.013)       # 1 - 0.0013 rounds back to 1 in bf16
    opt.step()
    assert seen == [("pre", [1.0] * 3), ("post", [1.0] * 3)]   # the post hook sees the rounded weights
    handle.remove()
    w.grad = torch.full((3,), 0.05)        # 1 - 0.005 rounds to 1 - 2**-8
    opt.step()
    assert len(seen) == 3 and w.tolist() == [1 - 2**-8] * 3


EVERY_REMEDY = {
    "nearest": {}, "stochastic": {"rounding": "stochastic"}, "sr4": {"rounding": "stochastic", "rand_bits": 4},
    "kahan": {"compensation": "kahan"}, "kahan_bf16": {"compensation": "kahan", "compensation_format": "bf16"},
    "master": {"master_weights": True}, "state_bf16": {"state_format": "bf16"},
    "stochastic_state": {"rounding": "stochastic", "state_format": "bf16", "state_rounding": "stochastic"},
    "plan": {"plan": {"0.weight": "master", "0.bias": "kahan", "2.weight": "stochastic", "2.bias": "nearest"}},
}


def _tensors(state):
    """Every tensor of a state dict (nested), by its path."""
    if torch.is_tensor(state):
        return {"": state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return {f"{k}/{path}": t for k, v in items for path, t in _tensors(v).items()}


@pytest.mark.parametrize("remedy", list(EVERY_REMEDY))
def test_a_wrapper_loaded_from_its_state_dict_continues_with_the_same_bits(remedy):
    """Everything the wrapper keeps from step to step is in its state dict: a new model and
    wrapper loaded from a checkpoint take the same steps as the run that went on."""
    def make():
        model = small_model()
        options = dict(EVERY_REMEDY[remedy])
        if "plan" in options:
            names = [n for n, _ in model.named_parameters()]
            options["plan"] = lp.FreezePlan("bf16", options["plan"], positions={n: names.index(n) for n in names})
        return model, LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "bf16", generator=3,
                                            **options)

    model, opt = make()
    for s in range(3):
        step_once(model, opt, s)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for s in range(3, 6):
        step_once(model, opt, s)
    model2, opt2 = make()
    step_once(model2, opt2, 9)          # a different history, overwritten by the checkpoint
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    for s in range(3, 6):
        step_once(model2, opt2, s)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))
    went_on, resumed = _tensors(opt.state_dict()), _tensors(opt2.state_dict())
    assert went_on.keys() == resumed.keys()
    assert all(torch.equal(went_on[k], resumed[k]) for k in went_on), remedy


def test_the_wrapper_is_a_torch_optimizer_sharing_the_inner_ones_groups_and_state():
    model = small_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = LowPrecisionOptimizer(inner, "bf16")
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    step_once(model, opt)
    torch.optim.Optimizer.zero_grad(opt)         # torch's own zero_grad, on the shared groups
    assert all(p.grad is None for p in model.parameters())
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(("load", "lowprec" in sd)))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("loaded"))
    state = opt.state_dict()
    assert seen == ["pre"] and state["extra"] == 1 and "lowprec" in state
    opt.load_state_dict(state)
    assert seen == ["pre", ("load", True), "loaded"]
    assert opt.state is inner.state and opt.param_groups is inner.param_groups   # shared again after loading


def test_tensors_move_between_the_packs_of_one_wrapper():
    # the first rounding packs every small tensor together; the steps round each remedy's tensors
    # in a pack of their own, and the tensors move there from the first pack's buffer
    model = small_model()
    plan = {"0.weight": "stochastic", "0.bias": "stochastic", "2.weight": "nearest", "2.bias": "nearest"}
    names = [n for n, _ in model.named_parameters()]
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "bf16", generator=1, pack=True,
                                plan=lp.FreezePlan("bf16", plan, positions={n: names.index(n) for n in names}))
    params = dict(model.named_parameters())
    assert len(_storages(params.values())) == 1
    step_once(model, opt)
    sr, rne = [params["0.weight"], params["0.bias"]], [params["2.weight"], params["2.bias"]]
    assert len(_storages(sr)) == 1 and len(_storages(rne)) == 1 and _storages(sr) != _storages(rne)
    assert opt.held_bytes() == 0           # the buffers are the tensors' own
