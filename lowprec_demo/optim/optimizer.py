"""The :class:`LowPrecisionOptimizer` and :func:`bytes_per_parameter`; the remedies are
described in :mod:`lowprec_demo.optim`, with an example."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from lowprec_demo.formats import FloatFormat, check_overflow_policy, format_of_dtype, get_format
from lowprec_demo.optim import sharding, storage
from lowprec_demo.optim.options import (COMPENSATIONS, PARAM_SELECTIONS, ParamSelection, check_options,
                                         make_generator, select_params)
from lowprec_demo.optim.packing import PackCache, group
from lowprec_demo.optim.plan import PLAN_REMEDIES, FreezePlan, resolve_plan
from lowprec_demo.rounding.round_to_grid import MAX_NUMEL
from lowprec_demo.rounding import ROUNDING_MODES, GeneratorLike, quantize, quantize_

__all__ = ["LowPrecisionOptimizer", "select_params", "bytes_per_parameter", "PARAM_SELECTIONS", "COMPENSATIONS"]


def bytes_per_parameter(optimizer: torch.optim.Optimizer) -> dict:
    """Bytes per parameter element, as an implementation that really keeps each tensor in its format would store them:
    ``weights`` (the format's width for the low-precision parameters), ``master`` copies (4 bytes; a bf16 weight's
    16-bit remainder: 2), optimizer ``state`` (once a step made it), ``compensation`` buffers and their ``total``
    (gradients and activations: the same for all); and ``held``, what the process holds: every parameter, every tensor
    of the optimizer's state and of the wrapper, by the tensors' own sizes (``total`` where the parameters are really
    stored in bf16 or fp16; more where a format is simulated in float32).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(10))
        >>> opt = torch.optim.AdamW([w]); w.grad = torch.ones(10); opt.step()
        >>> bytes_per_parameter(opt)["total"]   # 4 (float32) + 2 x 4 (Adam's two moments)
        12.0
    """
    wrapper = optimizer if isinstance(optimizer, LowPrecisionOptimizer) else None
    inner = wrapper.optimizer if wrapper is not None else optimizer
    width = lambda fmt, t: fmt.bits / 8 if fmt is not None else t.element_size()   # noqa: E731
    totals, count, held = {"weights": 0.0, "master": 0.0, "state": 0.0, "compensation": 0.0}, 0, 0
    for p in (p for group in inner.param_groups for p in group["params"]):
        n, remedy = p.numel(), wrapper.remedy_of(p) if wrapper is not None else None
        count += n
        held += n * p.element_size() + sum(v.numel() * v.element_size() for v in inner.state.get(p, {}).values()
                                           if torch.is_tensor(v))
        totals["weights"] += n * width(wrapper.fmt if remedy else None, p)
        totals["master"] += n * {"master": 4, "remainder": 2}.get(remedy, 0)
        if remedy == "kahan":
            totals["compensation"] += n * (wrapper.compensation_format.bits / 8 if wrapper.compensation_format
                                           else wrapper.buffer_dtype(p).itemsize)
        for value in _elementwise_state(inner, p):
            totals["state"] += n * width(wrapper.state_format if remedy else None, value)
    out = {k: v / max(count, 1) for k, v in totals.items()}
    out["total"] = sum(out.values())
    out["held"] = (held + (wrapper.held_bytes() if wrapper is not None else 0)) / max(count, 1)
    return out


def _elementwise_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> list:
    """The optimizer's per-element state tensors of ``p`` (Adam's moments, momentum)."""
    return [v for v in optimizer.state.get(p, {}).values()
            if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape]


def _flat32(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is contiguous float32 on ``device`` (Kahan's two packs take it)."""
    return t.dtype == torch.float32 and t.is_contiguous() and t.device == device


def _packable(t: torch.Tensor) -> bool:
    """Whether the fused kernels round ``t`` in place (in a pack)."""
    return t.dtype == torch.float32 and t.is_contiguous() and t.numel() <= MAX_NUMEL


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """Keep selected parameters on the grid of ``fmt`` (a name such as ``"bf16"``, or a FloatFormat; ``overflow``
    overrides its policy) after every step of ``optimizer`` (any ``torch.optim`` optimizer over float32 or float64
    parameters, or parameters really stored in torch.bfloat16 or torch.float16: :mod:`~lowprec_demo.optim.storage`),
    stored with the remedy of ``rounding``, ``compensation``, ``compensation_format`` and ``master_weights``
    (:mod:`lowprec_demo.optim`). ``generator``: a ``torch.Generator``, or an int seed for a new CPU
    generator (the same seed keeps data-parallel replicas bit-identical); ``rand_bits``: few-bit SR. ``params``: the
    parameters kept in low precision (:func:`select_params`), their optimizer state (Adam's moments) on the grid of
    ``state_format`` with ``state_rounding`` (None: unrounded in float32, or for parameters really stored in bf16 or
    fp16 their own dtype, as torch keeps it); ``round_initial``: round them now, for the first forward pass. ``plan``: a
    :class:`~lowprec_demo.optim.plan.FreezePlan` giving each tensor it names its remedy (leave the remedy arguments and
    ``params`` at their defaults), found by name in ``model`` or, without it, by its recorded position and shape.

    ``param_groups``, ``defaults`` and ``state`` are the inner optimizer's (the same objects), so LR schedulers and
    ``zero_grad`` act on it; the hooks registered on this optimizer run around its :meth:`step`, :meth:`state_dict`
    and :meth:`load_state_dict`. :meth:`state_dict` holds its own state too (Kahan buffers, master copies, the
    generator's): a wrapper loaded from it takes the same steps. The small parameters rounded together, and Kahan's
    weights and buffers, move into one flat buffer per group (:mod:`lowprec_demo.optim.packing`): a step rounds them
    in one call, and a tensor taken from ``p.data`` before wrapping no longer shares memory with ``p``. FSDP2's
    sharded parameters store the bits one process would (:mod:`lowprec_demo.optim.sharding`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, fmt: Union[str, FloatFormat], rounding: str = "nearest",
                 generator: GeneratorLike = None, rand_bits: Optional[int] = None, params: ParamSelection = "all",
                 state_format: Union[str, FloatFormat, None] = None, state_rounding: str = "nearest",
                 compensation: Optional[str] = None, overflow: Optional[str] = None, round_initial: bool = True,
                 compensation_format: Union[str, FloatFormat, None] = None, master_weights: bool = False,
                 plan: Optional[FreezePlan] = None, model: Optional[torch.nn.Module] = None) -> None:
        check_options(optimizer, fmt, rounding, state_rounding, compensation, compensation_format, master_weights,
                       params, plan, model)
        self.fmt = get_format(fmt)
        self.overflow = self.fmt.overflow if overflow is None else overflow
        check_overflow_policy(self.fmt, self.overflow)
        self.state_format = None if state_format is None else get_format(state_format)
        self.optimizer, self.plan, self.selection = optimizer, plan, params
        self.rounding, self.state_rounding, self.rand_bits = rounding, state_rounding, rand_bits
        self.compensation, self.master_weights = compensation, master_weights
        self._single = "master" if master_weights else compensation if compensation is not None else rounding
        self.generator = make_generator(generator)
        # torch's Optimizer sets up the hooks; add_param_group leaves the inner optimizer's groups as they are
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups, self.state = optimizer.param_groups, optimizer.state   # shared, not copied
        buffer_format = plan.kahan_format if plan is not None else compensation_format
        self.compensation_format = None if buffer_format is None else get_format(buffer_format)
        all_params = [p for group in optimizer.param_groups for p in group["params"]]
        by_id = None if plan is None else resolve_plan(plan, all_params, model)
        self.lowprec_params = select_params(all_params, params if by_id is None else lambda p: id(p) in by_id)
        self._remedy = {p: self._single if by_id is None else by_id[id(p)] for p in self.lowprec_params}
        # in state_dict: the Kahan buffers (made at the first step), the master copies and the remainders
        self._compensation_buffers, self._masters, self._remainders = {}, {}, {}
        self._check_and_copy(self.lowprec_params)
        if self.params_with("feedback"):
            storage.check_feedback(optimizer)
        self.packs = PackCache()    # the packs of small tensors and of Kahan's weights and buffers
        self._opened: dict = {}     # during a step: the parameters stored in bf16/fp16, with float32 working copies
        self._stored = [p for p in self.lowprec_params if storage.is_stored(p)]
        if round_initial:
            self.round_params()

    def _group_by_remedy(self) -> dict:
        return {r: [p for p in self.lowprec_params if self._remedy[p] == r] for r in PLAN_REMEDIES}

    def _check_and_copy(self, params: list) -> None:
        """Check new low-precision parameters' dtypes; take their master copies (before any rounding), remainders."""
        for p in params:
            if p.dtype not in (torch.float32, torch.float64, *storage.STORED_DTYPES):
                raise TypeError(f"a LowPrecisionOptimizer keeps parameters in float32 or float64 (a format simulated "
                                f"on them) or really stored in torch.bfloat16 or torch.float16; got {p.dtype}")
            if storage.is_stored(p) and format_of_dtype(p.dtype) != self.fmt.name:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is stored in {p.dtype}, whose grid is "
                                 f"{format_of_dtype(p.dtype)}; this optimizer's format is {self.fmt.name}: give "
                                 f"fmt={format_of_dtype(p.dtype)!r}, or keep the parameters in float32 to simulate "
                                 f"{self.fmt.name}")
            if storage.is_stored(p) and sharding.is_sharded(p):
                raise ValueError("FSDP2 parameters are rounded in float32 or float64 (a simulated format); these are "
                                 f"stored in {p.dtype}: shard a float32 model")
            if self._remedy[p] == "remainder" and (self.fmt.name != "bf16" or p.dtype == torch.float64):
                raise ValueError(f"the remainder remedy keeps a float32 master as bf16 plus 16 bits: it needs the "
                                 f"bf16 format on float32 or bfloat16 parameters; got {self.fmt.name} on {p.dtype}")
            sharding.check_placements(p)    # FSDP2's Shard(0) (and Replicate) only
        self._by_remedy = self._group_by_remedy()
        self._masters.update({p: p.detach().to(torch.float64 if p.dtype == torch.float64 else torch.float32, copy=True)
                              for p in params if self._remedy[p] == "master"})
        for p in (p for p in params if self._remedy[p] == "remainder"):   # stored as the split now (exact, bf16)
            stored, self._remainders[p] = storage.split_remainder(p.detach().float())
            p.data.copy_(stored)

    def buffer_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype of ``param``'s Kahan buffer: its own when simulated; the buffer format's when really stored."""
        return storage.storage_dtype(self.compensation_format, torch.float32) if (
            param in self._opened or storage.is_stored(param)) else param.dtype

    def state_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype of the elementwise optimizer state of a parameter really stored in bf16 or fp16 between steps."""
        return storage.storage_dtype(self.state_format, param.dtype)

    def remedy_of(self, param: torch.Tensor) -> Optional[str]:
        """How ``param`` is stored, one of :data:`~lowprec_demo.optim.plan.PLAN_REMEDIES` (None: full precision)."""
        return self._remedy.get(param)

    def params_with(self, remedy: str) -> list:
        """The low-precision parameters stored with ``remedy``, in the optimizer's order."""
        return self._by_remedy[remedy]

    def _store(self, tensors: list, fmt: FloatFormat, rounding: str, working: Optional[bool] = None) -> None:
        """``t.copy_(quantize(t, ...))`` per tensor, in fewer memory passes: the small contiguous float32 ones rounded
        in their pack's buffer, where they then live (one call, and for SR one seed, per pack); the rest one by one."""
        policy = self.overflow if fmt is self.fmt else fmt.overflow
        if working is None:     # float32 working copies (of bf16/fp16 storage) are not adopted into packs
            working = any(t in self._opened for t in tensors)
        # (working copies: packs made for this call only, so that no cache keeps them)
        plan = (PackCache() if working else self.packs).plan(tensors, _packable)
        if sharding.any_sharded(tensors):   # FSDP2: each process rounds its pieces, with the whole tensors' bits
            sharding.store_pieces(plan, fmt, rounding, self.generator, self.rand_bits, policy)
            return
        kw = dict(generator=self.generator, rand_bits=self.rand_bits, overflow=policy)
        for members, pack in plan:
            if pack is None:    # one tensor
                members[0].copy_(quantize(members[0], fmt, rounding, **kw))
            else:
                quantize_(pack.flat(members, adopt=None if working else self.packs.adopted), fmt, rounding, **kw)
                pack.put_back(members)

    @torch.no_grad()
    def round_params(self, rounding: str = "nearest") -> None:
        """Round the selected parameters onto the grid in place: to nearest, or with
        ``rounding="stochastic"`` drawing from the optimizer's generator (as a step does)."""
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDING_MODES)}; got {rounding!r}")
        self._store([p for p in self.lowprec_params if not storage.is_stored(p)], self.fmt, rounding)

    def held_bytes(self) -> int:
        """The memory kept from step to step beyond the parameters and the inner optimizer's state:
        the packs' buffers (none while the tensors live in them), Kahan buffers, master copies."""
        local, kahan = sharding.local_part, self.params_with("kahan")
        held = self.packs.held_bytes([local(p) for p in kahan], [local(self._compensation_buffers[p]) for p in kahan
                                                                 if p in self._compensation_buffers])
        buffers = [*self._compensation_buffers.values(), *self._masters.values(), *self._remainders.values()]
        return held + sum(local(b).numel() * b.element_size() for b in buffers)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """The parameters stored in bf16/fp16 stepped (:meth:`step_stored`), then the inner optimizer's step over the
        others between :meth:`before_inner_step` and :meth:`after_inner_step`."""
        loss = None
        if self._stored and closure is not None:
            with torch.enable_grad():
                loss, closure = closure(), None     # (one evaluation, before any weight moves)
        hidden = self.step_stored()
        try:
            self.before_inner_step()
            out = self.optimizer.step(closure)
            self.after_inner_step()
        finally:
            self.show_grads(hidden)
        return out if loss is None else loss

    def step_stored(self) -> dict:
        """Step the parameters really stored in bf16/fp16 (none: nothing to do), a pack at a time (a large tensor
        alone, small ones together, :func:`~lowprec_demo.optim.packing.group`): float32 working copies of a pack's
        weights, gradients and state, the inner optimizer's step over them alone (without its step hooks), the remedy,
        back into storage. Their gradients are then hidden from the inner optimizer's own step (which skips a
        parameter without one): returns them for :meth:`show_grads`."""
        if not self._stored:
            return {}
        inner, groups = self.optimizer, self.optimizer.param_groups
        raw = type(inner).step
        raw = raw.__wrapped__ if getattr(raw, "hooked", False) else raw     # torch's wrapper runs the hooks
        try:
            for run in group(self._stored):
                chunk = {self._stored[i] for i in run}
                inner.param_groups = [{**g, "params": [p for p in g["params"] if p in chunk]} for g in groups]
                self._opened = storage.open_step([self._stored[i] for i in run], inner.state)
                try:
                    self.before_inner_step(chunk)
                    raw(inner)
                    self.after_inner_step(chunk)
                finally:
                    self._close(keep=False)     # (after_inner_step closed it, unless the step failed)
        finally:
            inner.param_groups = self.param_groups = groups
        hidden = {p: p.grad for p in self._stored}
        for p in self._stored:
            p.grad = None
        return hidden

    @staticmethod
    def show_grads(hidden: dict) -> None:
        """Give back the gradients :meth:`step_stored` hid."""
        for p, grad in hidden.items():
            p.grad = grad

    def before_inner_step(self, only: Optional[set] = None) -> None:
        """The master copies and the remainders' masters into the parameters (those in ``only``; None: those not
        stored in bf16/fp16); called without grad by :meth:`step`, or around the steps of an optimizer the loop steps
        itself (:func:`~lowprec_demo.monitor.attach_plan`)."""
        masters = self._with("master", only)
        if masters:   # the step starts from the master copy (gradients are the rounded weights')
            local = sharding.local_part    # (a sharded parameter's own piece; a plain tensor itself)
            torch._foreach_copy_([local(p) for p in masters], [local(self._masters[p]) for p in masters])
        for p in self._with("remainder", only):
            p.copy_(storage.join_remainder(p, self._remainders[p]))

    def _with(self, remedy: str, only: Optional[set]) -> list:
        """The parameters stored with ``remedy`` in ``only`` (None: those simulated, not stored in bf16/fp16)."""
        if only is None:
            return [p for p in self.params_with(remedy) if not storage.is_stored(p)] if self._stored \
                else self.params_with(remedy)
        return [p for p in self.params_with(remedy) if p in only]

    def _close(self, keep: bool = True) -> None:
        opened, self._opened = self._opened, {}
        storage.close_step(opened, self.optimizer.state, self.state_dtype, keep)

    def after_inner_step(self, only: Optional[set] = None) -> None:
        """Every low-precision parameter (in ``only``, as in :meth:`before_inner_step`) stored with its remedy, then
        the state on its grid; working copies of bf16/fp16 storage put back."""
        local, working = sharding.local_part, bool(self._opened)
        masters, kahan = self._with("master", only), self._with("kahan", only)
        if masters:
            torch._foreach_copy_([local(self._masters[p]) for p in masters], [local(p) for p in masters])
            self._store(masters, self.fmt, "nearest")
        for p in self._with("remainder", only):
            p.copy_(storage.split_remainder(p, out=self._remainders[p])[0])
        if kahan:
            self.prepare_buffers()
            if not working:
                self._kahan([local(p) for p in kahan], [local(self._compensation_buffers[p]) for p in kahan],
                            adopt=not sharding.any_sharded(kahan))   # (FSDP2 keeps its pieces in storage of its own)
            else:    # float32 working buffers, no packs (they would hold float32 copies between steps)
                work = [self._compensation_buffers[p].float() for p in kahan]
                self._kahan(kahan, work, pack=False)
                torch._foreach_copy_([self._compensation_buffers[p] for p in kahan], work)
        if feedback := self._with("feedback", only):
            intended = [p.detach().clone() for p in feedback]
            self._store(feedback, self.fmt, self.rounding)
            storage.feed_back(self.optimizer, feedback, torch._foreach_sub(intended, feedback))
        for rounding in ROUNDING_MODES:
            if members := self._with(rounding, only):
                self._store(members, self.fmt, rounding)
        params = [p for p in self.lowprec_params if (p in only if only is not None else not storage.is_stored(p))]
        state_format = self.state_format or (self.fmt if working else None)   # stored: as torch keeps it, on the grid
        if state_format is not None:
            self._store([v for p in params for v in _elementwise_state(self.optimizer, p)], state_format,
                        self.state_rounding, working=working)
        self._close()

    def _kahan(self, params: list, buffers: list, adopt: bool = True, pack: bool = True) -> None:
        """Kahan compensation: ``p + buf`` rounded is stored, the residual (exact) kept in the buffer,
        on its own grid if any: float32 tensors in two packs (where they live, with ``adopt``)."""
        kept = self.packs.pair is not None and self.packs.pair[0] == tuple(map(id, params))
        if not pack or not kept and not all(_flat32(t, params[0].device) for t in params + buffers):
            targets = torch._foreach_add(params, buffers)     # what the weights should be, residual included
            stored = [quantize(t, self.fmt, overflow=self.overflow) for t in targets]
            residual = torch._foreach_sub(targets, stored)
            if self.compensation_format is not None:   # a narrow buffer keeps the residual's leading bits
                residual = [quantize(r, self.compensation_format) for r in residual]
            torch._foreach_copy_(buffers, residual)
            torch._foreach_copy_(params, stored)
            return
        (p_pack, b_pack), record = self.packs.pair_of(params, buffers), self.packs.adopted if adopt else None
        p_flat, b_flat = p_pack.flat(params, record), b_pack.flat(buffers, record)
        b_flat.add_(p_flat)                                        # the target p + buf
        quantize_(p_flat.copy_(b_flat), self.fmt, overflow=self.overflow)   # stored
        b_flat.sub_(p_flat)                                        # the residual, exact
        if self.compensation_format is not None:
            quantize_(b_flat, self.compensation_format)
        p_pack.put_back(params)     # nothing to do while they live in the packs
        b_pack.put_back(buffers)

    def prepare_buffers(self) -> None:
        """Make the Kahan compensation buffers (zeros) that the first step would make."""
        self._compensation_buffers.update({p: torch.zeros_like(p, dtype=self.buffer_dtype(p))
                                           for p in self.params_with("kahan") if p not in self._compensation_buffers})

    @torch.no_grad()
    def prepare_state(self) -> None:
        """Create every state tensor a step would (the inner optimizer's by a step at learning rate
        0 on zero gradients), changing no weight and drawing no random bit: :meth:`state_dict` is
        then the template ``torch.distributed.checkpoint.load`` fills in place::

            state = {"optimizer": opt.state_dict()}                 # saving
            dcp.save(state, checkpoint_id=folder)
            opt.prepare_state(); state = {"optimizer": opt.state_dict()}   # loading, into a new optimizer
            dcp.load(state, checkpoint_id=folder); opt.load_state_dict(state["optimizer"])
        """
        self.prepare_buffers()
        if self.optimizer.state:
            return
        _, params, _ = self._param_index()
        grads, lrs = [p.grad for p in params], [group.get("lr") for group in self.optimizer.param_groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            for group in (group for group in self.optimizer.param_groups if "lr" in group):
                group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
            self._opened = storage.open_step(self._stored, self.optimizer.state)
            self.optimizer.step()   # the inner one: no rounding, no random bits
        finally:
            self._close()
            for p, g in zip(params, grads):
                p.grad = g
            for group, lr in zip(self.optimizer.param_groups, lrs):
                if lr is not None:
                    group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (delegates to the inner optimizer)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer (unless it has it: torch's ``Optimizer.__init__``
        passes its own), its parameters selected as at construction and rounded onto the grid."""
        if any(group is param_group for group in self.optimizer.param_groups):
            return
        if self.plan is not None:
            raise ValueError("a FreezePlan names the tensors it was made for: make the plan with every param group "
                             "in the optimizer, then wrap it")
        self.optimizer.add_param_group(param_group)
        new = select_params(self.optimizer.param_groups[-1]["params"], self.selection)
        self.lowprec_params.extend(new)
        self._remedy.update({p: self._single for p in new})
        self._check_and_copy(new)
        self._stored = [p for p in self.lowprec_params if storage.is_stored(p)]
        with torch.no_grad():
            self._store([p for p in new if not storage.is_stored(p)], self.fmt, "nearest")

    def _param_index(self) -> tuple:
        """``({id(param): index}, params)`` in the optimizer's order, and the plan by index (None without one)."""
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        return index, order, None if self.plan is None else {index[id(p)]: r for p, r in self._remedy.items()}

    def state_dict(self) -> dict:
        """The inner optimizer's plus ``"lowprec"``: the settings, buffers, copies and generator state."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state, (index, _, plan), gen = self.optimizer.state_dict(), self._param_index(), self.generator
        state["lowprec"] = {
            "format": {k: getattr(self.fmt, k) for k in ("exp_bits", "man_bits", "kind", "name")},
            "overflow": self.overflow, "rounding": self.rounding, "rand_bits": self.rand_bits,
            "compensation": self.compensation,
            "compensation_format": None if self.compensation_format is None else self.compensation_format.name,
            "compensation_buffers": {index[id(p)]: b.clone() for p, b in self._compensation_buffers.items()},
            "master_weights": {index[id(p)]: b.clone() for p, b in self._masters.items()}, "plan": plan,
            "remainders": {index[id(p)]: b.clone() for p, b in self._remainders.items()},
            "generator_state": gen.get_state() if isinstance(gen, torch.Generator) else None}
        for hook in self._optimizer_state_dict_post_hooks.values():
            returned = hook(self, state)
            state = state if returned is None else returned
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state dict written by :meth:`state_dict` (or a plain inner-optimizer one)."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        state_dict = dict(state_dict)
        extra = state_dict.pop("lowprec", None)
        self.optimizer.load_state_dict(state_dict)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        _, order, _ = self._param_index()
        for i, saved in state_dict.get("state", {}).items():    # torch casts the state to the parameter's dtype
            p = order[int(i)]
            if p in self._remedy and storage.is_stored(p):
                st = self.optimizer.state[p]
                st.update({k: saved[k].to(device=p.device, dtype=self.state_dtype(p)).clone()
                           for k in storage.elementwise_keys(st, p)})
        if extra is not None:
            self._load_lowprec(extra)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _load_lowprec(self, extra: dict) -> None:
        saved = extra["format"]
        if any(saved[k] != getattr(self.fmt, k) for k in ("exp_bits", "man_bits", "kind")):
            raise ValueError(f"state dict was saved for format {saved['name']}, this optimizer uses {self.fmt.name}")
        _, order, mine = self._param_index()
        theirs = None if extra.get("plan") is None else {int(i): r for i, r in extra["plan"].items()}
        if theirs != mine:
            raise ValueError("the state dict was saved with a different freeze plan (or with none): build this "
                             "optimizer with the plan it was saved with")
        like = lambda b, t: b.to(device=t.device, dtype=t.dtype).clone()   # noqa: E731
        self._compensation_buffers = {order[int(i)]: like(b, torch.empty(0, dtype=self.buffer_dtype(order[int(i)]),
                                                                         device=order[int(i)].device))
                                      for i, b in extra.get("compensation_buffers", {}).items()}
        for name, kept in (("master_weights", self._masters), ("remainders", self._remainders)):
            kept.update({order[int(i)]: like(b, kept[order[int(i)]]) for i, b in extra.get(name, {}).items()
                         if order[int(i)] in kept})
        if extra.get("generator_state") is not None and isinstance(self.generator, torch.Generator):
            self.generator.set_state(extra["generator_state"])

    def __repr__(self) -> str:
        parts = [self.optimizer.__class__.__name__, f"fmt={self.fmt.name!r}", f"rounding={self.rounding!r}",
                 f"params={len(self.lowprec_params)} tensors",
                 self._stored and f"stored={len(self._stored)} tensors in {self._stored[0].dtype}",
                 self.state_format and f"state_format={self.state_format.name!r}",
                 self.compensation and f"compensation={self.compensation!r}",
                 self.compensation_format and f"compensation_format={self.compensation_format.name!r}",
                 self.master_weights and "master_weights=True",
                 self.plan and "plan=" + "/".join(f"{r} {len(self.params_with(r))}" for r in PLAN_REMEDIES
                                                  if self.params_with(r))]
        return f"LowPrecisionOptimizer({', '.join(p for p in parts if p)})"
