"""Low-precision stored weights for any torch optimizer.

``LowPrecisionOptimizer`` wraps a ``torch.optim`` optimizer. The inner optimizer computes its step
in the parameters' own dtype (float32), then every selected parameter is rounded back onto the
low-precision grid. So the weights that are stored, and used by the next forward pass, are exactly
those of a model kept in that format ("bf16-equivalent stored weights" for ``fmt="bf16"``).

Three ways to store the result of a step:

``rounding="nearest"``
    Round to nearest, ties to even. An update below half an ulp of the weight is lost: the weight
    freezes although its gradient is not zero.
``rounding="stochastic"``
    Stochastic rounding, unbiased: small updates move the weight with probability ``|d|/ulp``.
``compensation="kahan"``
    Nearest rounding plus a per-element compensation buffer that carries the rounding residual
    into the next step, as in Kahan summation: lost updates pile up until they are big enough to
    move the weight. The buffer is kept in the parameter's dtype (float32, 4 bytes a parameter),
    or on a grid of its own with ``compensation_format`` (``"bf16"``: 2 bytes, as torch-optimi
    keeps it; the residual is then itself rounded and only its leading bits carry over).
``master_weights=True``
    Mixed precision: a float32 master copy of every selected parameter takes the optimizer's
    steps, and the parameters the forward pass sees are that copy rounded to nearest. Nothing is
    lost (the master keeps every update); it costs 4 bytes a parameter more.

Optimizer state (Adam's moments, momentum buffers) can be kept on a grid too (``state_format``).
:func:`bytes_per_parameter` counts what a setting stores per parameter.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "bf16")
    >>> w.grad = torch.ones(3); opt.step()
    >>> w.tolist()   # 1 - 0.001 is closer to 1.0 than to 1 - 2**-8: frozen
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Optional, Union

import torch

from lowprec_demo.rounding import kernels
from lowprec_demo.optim import sharding
from lowprec_demo.optim.packing import Pack, packs
from lowprec_demo.formats import FloatFormat, check_overflow_policy, get_format
from lowprec_demo.optim.plan import FreezePlan, resolve_plan
from lowprec_demo.rounding.core import ROUNDING_MODES, GeneratorLike, quantize, quantize_

__all__ = ["LowPrecisionOptimizer", "select_params", "bytes_per_parameter", "PARAM_SELECTIONS",
           "COMPENSATIONS"]

PARAM_SELECTIONS = ("all", "matrices")
COMPENSATIONS = (None, "kahan")

ParamSelection = Union[str, Callable[[torch.Tensor], bool], Iterable[torch.Tensor]]


def select_params(params: Iterable[torch.Tensor], which: ParamSelection = "all") -> list:
    """The parameters to keep in low precision.

    ``"all"``; ``"matrices"`` (tensors with 2 or more dimensions: linear and embedding weights,
    convolution kernels); a predicate ``f(tensor) -> bool``; or an explicit collection of tensors.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> [tuple(p.shape) for p in select_params(lin.parameters(), "matrices")]
        [(2, 2)]
    """
    params = list(params)
    if isinstance(which, str):
        if which == "all":
            return params
        if which == "matrices":
            return [p for p in params if p.dim() >= 2]
        raise ValueError(f"params must be one of {', '.join(PARAM_SELECTIONS)}, a predicate or a "
                         f"collection of tensors; got {which!r}")
    if callable(which):
        return [p for p in params if which(p)]
    chosen = {id(p) for p in which}
    return [p for p in params if id(p) in chosen]


def bytes_per_parameter(optimizer: torch.optim.Optimizer) -> dict:
    """What a training setting stores per parameter element, as an implementation that really
    keeps each tensor in its format would: ``weights`` (the storage format's width for the
    selected parameters of a :class:`LowPrecisionOptimizer`, the dtype's size otherwise),
    ``master`` (float32 master copies), ``state`` (the optimizer's per-element state tensors, at
    ``state_format``'s width when set; count after a step, once the state exists),
    ``compensation`` (Kahan buffers) and their ``total``, averaged over all elements. Gradients and
    activations are left out: they are the same for every setting.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(10))
        >>> opt = torch.optim.AdamW([w]); w.grad = torch.ones(10); opt.step()
        >>> bytes_per_parameter(opt)["total"]   # 4 (float32) + 2 x 4 (Adam's two moments)
        12.0
    """
    wrapper = optimizer if isinstance(optimizer, LowPrecisionOptimizer) else None
    inner = wrapper.optimizer if wrapper is not None else optimizer
    chosen = {id(p) for p in wrapper.lowprec_params} if wrapper is not None else set()
    totals = {"weights": 0.0, "master": 0.0, "state": 0.0, "compensation": 0.0}
    count = 0
    for group in inner.param_groups:
        for p in group["params"]:
            n, low = p.numel(), id(p) in chosen
            count += n
            totals["weights"] += n * (wrapper.fmt.bits / 8 if low else p.element_size())
            remedy = wrapper.remedy_of(p) if low else None
            if remedy == "master":
                totals["master"] += n * 4
            if remedy == "kahan":
                fmt = wrapper.compensation_format
                totals["compensation"] += n * (fmt.bits / 8 if fmt is not None else p.element_size())
            for value in inner.state.get(p, {}).values():
                if torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape:
                    fmt = wrapper.state_format if low else None
                    totals["state"] += n * (fmt.bits / 8 if fmt is not None else value.element_size())
    out = {k: v / max(count, 1) for k, v in totals.items()}
    out["total"] = sum(out.values())
    return out


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """Keep selected parameters on the grid of ``fmt`` after every step of ``optimizer``.

    Args:
        optimizer: any ``torch.optim`` optimizer over float32 (or float64) parameters.
        fmt: the storage format, a name such as ``"bf16"`` or ``"e4m3"``, or a FloatFormat.
        rounding: ``"nearest"`` or ``"stochastic"``.
        generator: SR randomness: a ``torch.Generator`` (reproducible) or an int seed, which seeds a
            new CPU generator, so that every step draws fresh bits. Give every data-parallel
            replica the same seed so replicas stay bit-identical.
        rand_bits: few-bit SR with this many random bits (None: full resolution).
        params: which parameters live in low precision: ``"all"``, ``"matrices"`` (2 or more
            dimensions), a predicate, or a collection of tensors. Others stay in full precision.
        state_format: also keep the optimizer's state tensors (e.g. Adam's ``exp_avg`` and
            ``exp_avg_sq``) of the selected parameters on this grid (None: full precision).
        state_rounding: rounding for the state, ``"nearest"`` or ``"stochastic"``.
        compensation: None or ``"kahan"`` (nearest rounding with a compensation buffer).
        compensation_format: the grid the Kahan buffer is kept on (None: the parameter's dtype).
        master_weights: keep a float32 master copy that takes the steps; the parameters hold
            it rounded to nearest (``rounding`` must be ``"nearest"``, no compensation).
        overflow: override the format's overflow policy.
        round_initial: round the selected parameters onto the grid now (default True), so the
            stored weights are low-precision from the first forward pass.
        plan: a :class:`~lowprec_demo.freeze_plan.FreezePlan` (``watch.plan(fmt)``): each tensor it
            names is stored with its own remedy (``"nearest"``, ``"stochastic"``, ``"kahan"`` with
            the plan's buffer format, ``"master"``); the parameters it does not name stay in full
            precision. Leave ``rounding``, ``compensation``, ``compensation_format``,
            ``master_weights`` and ``params`` at their defaults: the plan chooses them.
        model: with ``plan``, the model whose ``named_parameters()`` give the plan's names; without
            it the plan finds its tensors by their recorded positions among the optimizer's
            parameters (each checked against its recorded shape).

    LR schedulers, ``zero_grad``, ``add_param_group`` and ``state_dict``/``load_state_dict``
    behave as for the inner optimizer; ``param_groups`` and ``state`` are the inner optimizer's.

    Storage: the small parameters (below :data:`lowprec_demo.packing.SMALL_NUMEL` elements) that
    are rounded together (with ``state_format``, their optimizer state too), and the weights and
    buffers of Kahan compensation, move into one flat buffer per group, where they stay: each
    one's ``.data`` becomes a view of it, with the same values, so that a step rounds the group
    in one call and copies nothing. The parameter objects are the same; a tensor taken from
    ``p.data`` before wrapping no longer shares memory with ``p``. Parameters that are views of
    a larger tensor, or share memory with one another, are not moved (their values are copied in
    and back at each step), nor are FSDP2's pieces.

    The parameters may be FSDP2's sharded ones (``fully_shard``: DTensors placed ``Shard(0)``,
    or ``Replicate()`` then ``Shard(0)`` for HSDP): each process rounds its own block of rows,
    stochastic rounding with the random bits one process would draw for those elements
    (:mod:`lowprec_demo.sharding`), and ``torch.distributed.checkpoint`` saves
    :meth:`state_dict` (see :meth:`prepare_state` for loading it into a new optimizer).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, fmt: Union[str, FloatFormat],
                 rounding: str = "nearest", generator: GeneratorLike = None,
                 rand_bits: Optional[int] = None, params: ParamSelection = "all",
                 state_format: Union[str, FloatFormat, None] = None, state_rounding: str = "nearest",
                 compensation: Optional[str] = None, overflow: Optional[str] = None,
                 round_initial: bool = True, compensation_format: Union[str, FloatFormat, None] = None,
                 master_weights: bool = False, plan: Optional[FreezePlan] = None,
                 model: Optional[torch.nn.Module] = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if plan is not None:
            if not isinstance(plan, FreezePlan):
                raise TypeError(f"plan must be a FreezePlan (watch.plan(fmt) or load_plan(path)), got {type(plan).__name__}")
            chosen = {"rounding": rounding != "nearest", "compensation": compensation is not None,
                      "compensation_format": compensation_format is not None, "master_weights": master_weights is True,
                      "params": not (isinstance(params, str) and params == "all")}
            given = [k for k, v in chosen.items() if v]
            if given:
                raise ValueError(f"plan= chooses the remedy of every tensor it names; leave {', '.join(given)} at "
                                 f"the default")
            if get_format(fmt).name != plan.format:
                raise ValueError(f"the plan is for {plan.format}; this optimizer stores {get_format(fmt).name}")
        elif model is not None:
            raise ValueError("model= tells a plan's names; give plan= too")
        for name, value in (("rounding", rounding), ("state_rounding", state_rounding)):
            if value not in ROUNDING_MODES:
                raise ValueError(f"{name} must be one of {', '.join(ROUNDING_MODES)}; got {value!r}")
        if compensation not in COMPENSATIONS:
            raise ValueError(f"compensation must be one of None, 'kahan'; got {compensation!r}")
        if compensation == "kahan" and rounding != "nearest":
            raise ValueError("compensation='kahan' is a remedy for round-to-nearest; use rounding='nearest'")
        if compensation_format is not None and compensation != "kahan":
            raise ValueError("compensation_format is the format of the Kahan buffer: give compensation='kahan' too")
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be True or False, got {master_weights!r}")
        if master_weights and (rounding != "nearest" or compensation is not None):
            raise ValueError("master_weights=True keeps every update in a float32 copy: use it with "
                             "rounding='nearest' and no compensation")
        self.fmt = get_format(fmt)
        self.overflow = self.fmt.overflow if overflow is None else overflow
        check_overflow_policy(self.fmt, self.overflow)
        self.state_format = None if state_format is None else get_format(state_format)
        self.optimizer = optimizer
        self.rounding = rounding
        self.state_rounding = state_rounding
        if isinstance(generator, bool) or not (generator is None or isinstance(generator, (int, torch.Generator))):
            raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {type(generator).__name__}")
        if isinstance(generator, int):  # one seed for the run, a fresh draw of bits for every step
            generator = torch.Generator().manual_seed(generator & ((1 << 63) - 1))
        self.generator = generator
        self.rand_bits = rand_bits
        self.compensation = compensation
        self.master_weights = master_weights
        self._selection = params
        all_params = [p for group in optimizer.param_groups for p in group["params"]]
        self.plan = plan
        if plan is not None:
            by_id = resolve_plan(plan, all_params, model)
            self.lowprec_params = [p for p in all_params if id(p) in by_id]
            self._remedy = {p: by_id[id(p)] for p in self.lowprec_params}
            self.compensation_format = None if plan.kahan_format is None else get_format(plan.kahan_format)
        else:
            self.lowprec_params = select_params(all_params, params)
            single = "master" if master_weights else "kahan" if compensation == "kahan" else rounding
            self._remedy = {p: single for p in self.lowprec_params}
            self.compensation_format = None if compensation_format is None else get_format(compensation_format)
        for p in self.lowprec_params:
            if p.dtype not in (torch.float32, torch.float64):
                raise TypeError(f"low-precision parameters are simulated in float32 or float64; got {p.dtype}")
            sharding.check_placements(p)    # FSDP2's Shard(0) (and Replicate) only
        self._compensation_buffers: dict = {}
        # the float32 (or float64) values before any rounding: what the optimizer steps
        self._masters: dict = {p: p.detach().clone() for p in self.params_with("master")}

        # Share the inner optimizer's bookkeeping, so schedulers and hooks see one object.
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        if round_initial:
            self.round_params()

    # ------------------------------------------------------------------------------------------
    def remedy_of(self, param: torch.Tensor) -> Optional[str]:
        """How ``param`` is stored: ``"nearest"``, ``"stochastic"``, ``"kahan"`` or ``"master"``;
        None for a parameter kept in full precision."""
        return self._remedy.get(param)

    def params_with(self, remedy: str) -> list:
        """The low-precision parameters stored with ``remedy``, in the optimizer's order."""
        cache = self.__dict__.setdefault("_by_remedy", {})
        if remedy not in cache:
            cache[remedy] = [p for p in self.lowprec_params if self._remedy[p] == remedy]
        return cache[remedy]

    def _round(self, t: torch.Tensor, fmt: FloatFormat, rounding: str) -> torch.Tensor:
        return quantize(t, fmt, rounding, generator=self.generator, rand_bits=self.rand_bits,
                        overflow=self.overflow if fmt is self.fmt else None)

    def _store(self, tensors: list, fmt: FloatFormat, rounding: str) -> None:
        """Round ``tensors`` onto ``fmt``'s grid in place: what ``t.copy_(self._round(t, ...))``
        does for each, in fewer passes over memory. Contiguous float32 tensors are rounded in
        place by the fused kernels, the small ones packed into one flat tensor (one call, and
        for SR one seed, per pack), where they live from then on (:meth:`Pack.flat
        <lowprec_demo.packing.Pack.flat>` with ``adopt``: each one's ``.data`` a view of the
        pack's buffer); anything else tensor by tensor."""
        policy = self.overflow if fmt is self.fmt else fmt.overflow
        if sharding.any_sharded(tensors):   # FSDP2: each process rounds its pieces, with the whole tensors' bits
            sharding.store_pieces(self._pack_plan(tensors), fmt, rounding, self.generator, self.rand_bits, policy)
            return
        for members, pack in self._pack_plan(tensors):
            if pack is None:
                for t in members:
                    t.copy_(self._round(t, fmt, rounding))
                continue
            flat = pack.flat(members, adopt=True)   # several: living in the pack's buffer, one: itself
            self._store_flat(flat, fmt, rounding, policy)
            pack.put_back(members)

    def _pack_plan(self, tensors: list) -> list:
        """``(members, pack)`` for the tensors: first those the fused path does not take, one by
        one with no pack, then the contiguous float32 ones in the packs of
        :func:`lowprec_demo.packing.packs` (one tensor, or a buffer for several small ones).
        Kept from step to step (the cache holds the tensors, so their ids stay theirs)."""
        key = tuple(id(t) for t in tensors)
        cache = self.__dict__.setdefault("_pack_cache", {})
        plan = cache.get(key)
        if plan is not None:
            return plan
        fast = [t for t in tensors
                if t.dtype == torch.float32 and t.is_contiguous() and t.numel() <= kernels.MAX_NUMEL]
        chosen = {id(t) for t in fast}
        plan = [([t], None) for t in tensors if id(t) not in chosen]
        plan += [([fast[i] for i in pack.indices], pack) for pack in packs(fast)]
        self._forget_packs(key, "rounding")
        if len(cache) >= 8:
            cache.clear()
        cache[key] = plan
        return plan

    def _forget_packs(self, key: tuple, made: str) -> None:
        """Drop the kept packs of any tensor in ``key`` (ids) but the ones just ``made``
        (``"rounding"`` or ``"kahan"``): the new packs adopt those tensors, so the old buffers
        would hold nothing but their memory."""
        ids = set(key)
        cache = self.__dict__.get("_pack_cache", {})
        for old in [k for k in cache if not (made == "rounding" and k == key) and ids.intersection(k)]:
            del cache[old]
        kahan = self.__dict__.get("_kahan_packs")
        if made != "kahan" and kahan is not None and ids.intersection(kahan[0]):
            del self._kahan_packs

    def _store_flat(self, t: torch.Tensor, fmt: FloatFormat, rounding: str, policy: str) -> None:
        quantize_(t, fmt, rounding, generator=self.generator, rand_bits=self.rand_bits, overflow=policy)

    @torch.no_grad()
    def round_params(self, rounding: str = "nearest") -> None:
        """Round the selected parameters onto the grid in place: to nearest, or with
        ``rounding="stochastic"`` drawing from the optimizer's generator (as a step does)."""
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDING_MODES)}; got {rounding!r}")
        self._store(self.lowprec_params, self.fmt, rounding)

    def held_bytes(self) -> int:
        """The memory this wrapper keeps from step to step beyond the parameters and the inner
        optimizer's state: the buffers of its packs of small tensors (none while the tensors
        live in them), the Kahan compensation buffers and the master copies."""
        held = sum(pack.held_bytes(members) for plan in self.__dict__.get("_pack_cache", {}).values()
                   for members, pack in plan if pack is not None)
        kahan = self.__dict__.get("_kahan_packs")
        if kahan is not None:
            local, kahan_params = sharding.local_part, self.params_with("kahan")
            held += kahan[1].held_bytes([local(p) for p in kahan_params]) + kahan[2].held_bytes(
                [local(self._compensation_buffers[p]) for p in kahan_params if p in self._compensation_buffers])
        buffers = list(self._compensation_buffers.values()) + list(self._masters.values())
        return held + sum(sharding.local_part(b).numel() * b.element_size() for b in buffers)

    @torch.optim.Optimizer.profile_hook_step   # runs the step hooks (register_step_pre_hook ...)
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One step of the inner optimizer, then store the selected parameters in low precision.
        Step hooks registered on this optimizer run before and after the whole step, rounding
        included."""
        self.before_inner_step()
        loss = self.optimizer.step(closure)
        self.after_inner_step()
        return loss

    def before_inner_step(self) -> None:
        """What precedes the inner optimizer's step: the master copies go into the parameters.
        :meth:`step` calls it; so do the hooks of :func:`~lowprec_demo.integrations.attach_plan`,
        around a step the loop makes itself (call it without grad)."""
        masters = self.params_with("master")
        if masters:   # the step starts from the master copy (gradients are the rounded weights')
            local = sharding.local_part    # (a sharded parameter's own piece; a plain tensor itself)
            torch._foreach_copy_([local(p) for p in masters], [local(self._masters[p]) for p in masters])

    def after_inner_step(self) -> None:
        """What follows the inner optimizer's step: every low-precision parameter stored with its
        remedy, then the state on its grid (called as :meth:`before_inner_step` is)."""
        local = sharding.local_part
        masters, kahan = self.params_with("master"), self.params_with("kahan")
        if masters:
            torch._foreach_copy_([local(self._masters[p]) for p in masters], [local(p) for p in masters])
            self._store(masters, self.fmt, "nearest")
        if kahan:
            self.prepare_buffers()
            self._kahan([local(p) for p in kahan], [local(self._compensation_buffers[p]) for p in kahan],
                        adopt=not sharding.any_sharded(kahan))   # (FSDP2 keeps its pieces in storage of its own)
        for rounding in ROUNDING_MODES:
            chosen = self.params_with(rounding)
            if chosen:
                self._store(chosen, self.fmt, rounding)
        if self.state_format is not None:
            states = []
            for p in self.lowprec_params:
                for value in self.optimizer.state.get(p, {}).values():
                    if torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape:
                        states.append(value)
            self._store(states, self.state_format, self.state_rounding)

    def _kahan(self, params: list, buffers: list, adopt: bool = True) -> None:
        """Kahan compensation, element by element: the target ``p + buf`` rounded to the grid is
        stored, the residual (exact: both are within an ulp) kept in the buffer, on its own grid
        when it has one. Float32 tensors on one device are done in place in two flat tensors,
        where the parameters and the buffers live from step to step (two packs that adopt
        them, unless ``adopt`` is false): four passes, nothing copied or allocated. Anything else
        tensor by tensor."""
        flat = self._kahan_flat(params, buffers, adopt)
        if flat is None:
            targets = torch._foreach_add(params, buffers)     # what the weights should be, residual included
            stored = [quantize(t, self.fmt, overflow=self.overflow) for t in targets]
            residual = torch._foreach_sub(targets, stored)
            if self.compensation_format is not None:   # a narrow buffer keeps the residual's leading bits
                residual = [quantize(r, self.compensation_format) for r in residual]
            torch._foreach_copy_(buffers, residual)
            torch._foreach_copy_(params, stored)
            return
        (p_pack, p_flat), (b_pack, b_flat) = flat
        b_flat.add_(p_flat)                                        # the target p + buf
        quantize_(p_flat.copy_(b_flat), self.fmt, overflow=self.overflow)   # stored
        b_flat.sub_(p_flat)                                        # the residual, exact
        if self.compensation_format is not None:
            quantize_(b_flat, self.compensation_format)
        p_pack.put_back(params)     # nothing to do while they live in the packs
        b_pack.put_back(buffers)

    def _kahan_flat(self, params: list, buffers: list, adopt: bool = True):
        """``((pack, flat), (pack, flat))`` of the parameters and of their buffers, each laid
        end to end in a pack that adopts them (:meth:`Pack.flat <lowprec_demo.packing.Pack.flat>`);
        None unless all are contiguous float32 tensors on one device."""
        key = tuple(map(id, params))
        kept = self.__dict__.get("_kahan_packs")
        if kept is None or kept[0] != key:
            if not all(t.dtype == torch.float32 and t.is_contiguous() and t.device == params[0].device
                       for t in params + buffers):
                return None
            kept = self._kahan_packs = (key, Pack(range(len(params)), params), Pack(range(len(buffers)), buffers))
            self._forget_packs(key, "kahan")
        _, p_pack, b_pack = kept
        return (p_pack, p_pack.flat(params, adopt)), (b_pack, b_pack.flat(buffers, adopt))

    def prepare_buffers(self) -> None:
        """Make the Kahan compensation buffers (zeros) that the first step would make."""
        for p in self.params_with("kahan"):
            if p not in self._compensation_buffers:
                self._compensation_buffers[p] = torch.zeros_like(p)

    @torch.no_grad()
    def prepare_state(self) -> None:
        """Create every state tensor a step would create, without changing a weight or drawing
        a random bit: the inner optimizer's state by one step at learning rate 0 on zero
        gradients (skipped once it has state), and the Kahan buffers. Then :meth:`state_dict`
        has the layout of a trained optimizer's, the template ``torch.distributed.checkpoint.load``
        fills in place before :meth:`load_state_dict`::

            state = {"optimizer": opt.state_dict()}                 # saving
            dcp.save(state, checkpoint_id=folder)
            opt.prepare_state(); state = {"optimizer": opt.state_dict()}   # loading, into a new optimizer
            dcp.load(state, checkpoint_id=folder); opt.load_state_dict(state["optimizer"])
        """
        self.prepare_buffers()
        if self.optimizer.state:
            return
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        lrs = [group.get("lr") for group in self.optimizer.param_groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            for group in self.optimizer.param_groups:
                if "lr" in group:
                    group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
            self.optimizer.step()   # the inner one: no rounding, no random bits
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            for group, lr in zip(self.optimizer.param_groups, lrs):
                if lr is not None:
                    group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (delegates to the inner optimizer)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group to the inner optimizer; its parameters are selected as at
        construction and rounded onto the grid."""
        if self.plan is not None:
            raise ValueError("a FreezePlan names the tensors it was made for: make the plan with every param group "
                             "in the optimizer, then wrap it")
        self.optimizer.add_param_group(param_group)
        new = select_params(self.optimizer.param_groups[-1]["params"], self._selection)
        self.lowprec_params.extend(new)
        single = "master" if self.master_weights else "kahan" if self.compensation == "kahan" else self.rounding
        self._remedy.update({p: single for p in new})
        self.__dict__.pop("_by_remedy", None)
        if self.master_weights:
            self._masters.update({p: p.detach().clone() for p in new})
        with torch.no_grad():
            self._store(new, self.fmt, "nearest")

    # ------------------------------------------------------------------------------------------
    def _param_index(self) -> dict:
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {id(p): i for i, p in enumerate(order)}, order

    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus a ``"lowprec"`` entry: format, rounding, the
        Kahan buffers and master copies (by parameter index) and the SR generator's state."""
        state = self.optimizer.state_dict()
        index, _ = self._param_index()
        gen = self.generator
        state["lowprec"] = {
            "format": {"exp_bits": self.fmt.exp_bits, "man_bits": self.fmt.man_bits,
                       "kind": self.fmt.kind, "name": self.fmt.name},
            "overflow": self.overflow,
            "rounding": self.rounding,
            "rand_bits": self.rand_bits,
            "compensation": self.compensation,
            "compensation_format": None if self.compensation_format is None else self.compensation_format.name,
            "compensation_buffers": {index[id(p)]: b.clone() for p, b in self._compensation_buffers.items()},
            "master_weights": {index[id(p)]: b.clone() for p, b in self._masters.items()},
            "plan": None if self.plan is None else {index[id(p)]: r for p, r in self._remedy.items()},
            "generator_state": gen.get_state() if isinstance(gen, torch.Generator) else None,
        }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state dict written by :meth:`state_dict` (or a plain inner-optimizer one)."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("lowprec", None)
        self.optimizer.load_state_dict(state_dict)
        self.state = self.optimizer.state
        self.param_groups = self.optimizer.param_groups
        if extra is None:
            return
        saved = extra["format"]
        if (saved["exp_bits"], saved["man_bits"], saved["kind"]) != (
                self.fmt.exp_bits, self.fmt.man_bits, self.fmt.kind):
            raise ValueError(f"state dict was saved for format {saved['name']}, this optimizer uses {self.fmt.name}")
        index, order = self._param_index()
        mine = None if self.plan is None else {index[id(p)]: r for p, r in self._remedy.items()}
        theirs = extra.get("plan")
        theirs = None if theirs is None else {int(i): r for i, r in theirs.items()}
        if theirs != mine:
            raise ValueError("the state dict was saved with a different freeze plan (or with none): build this "
                             "optimizer with the plan it was saved with")
        self._compensation_buffers = {
            order[int(i)]: b.to(device=order[int(i)].device, dtype=order[int(i)].dtype).clone()
            for i, b in extra.get("compensation_buffers", {}).items()
        }
        for i, b in extra.get("master_weights", {}).items():
            p = order[int(i)]
            if p in self._masters:
                self._masters[p] = b.to(device=p.device, dtype=p.dtype).clone()
        if extra.get("generator_state") is not None and isinstance(self.generator, torch.Generator):
            self.generator.set_state(extra["generator_state"])

    def __repr__(self) -> str:
        extra = f", compensation={self.compensation!r}" if self.compensation else ""
        if self.compensation_format is not None:
            extra += f", compensation_format={self.compensation_format.name!r}"
        if self.master_weights:
            extra += ", master_weights=True"
        state = f", state_format={self.state_format.name!r}" if self.state_format else ""
        if self.plan is not None:
            counts = {r: len(self.params_with(r)) for r in ("nearest", "stochastic", "kahan", "master")}
            extra += ", plan=" + "/".join(f"{r} {c}" for r, c in counts.items() if c)
        return (f"LowPrecisionOptimizer({self.optimizer.__class__.__name__}, fmt={self.fmt.name!r}, "
                f"rounding={self.rounding!r}, params={len(self.lowprec_params)} tensors{state}{extra})")
