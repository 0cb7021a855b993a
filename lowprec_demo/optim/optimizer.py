"""The :class:`LowPrecisionOptimizer` and :func:`bytes_per_parameter`; the remedies are
described in :mod:`lowprec_demo.optim`, with an example."""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Union

import torch

from lowprec_demo.common.packing import PackCache, copy_into, group, runs
from lowprec_demo.common.sharding import any_sharded, flat_offset, local_part
from lowprec_demo.formats import FloatFormat, check_overflow_policy, get_format
from lowprec_demo.optim import storage
from lowprec_demo.optim.options import (COMPENSATIONS, PARAM_SELECTIONS, ParamSelection, check_options, check_param,
                                         make_generator, select_params)
from lowprec_demo.optim.plan import PLAN_REMEDIES, FreezePlan, resolve_plan
from lowprec_demo.rounding.round_to_grid import MAX_NUMEL, _native_dtype
from lowprec_demo.rounding import ROUNDING_MODES, GeneratorLike, draw_seed, quantize_

__all__ = ["LowPrecisionOptimizer", "select_params", "PARAM_SELECTIONS", "COMPENSATIONS"]


def _packable(t: torch.Tensor) -> bool:
    """Whether the fused kernels round ``t`` in place (in a run of small tensors, in a pack)."""
    return t.dtype == torch.float32 and t.is_contiguous() and t.numel() <= MAX_NUMEL


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """Keep selected parameters on the grid of ``fmt`` (a name such as ``"bf16"``, or a FloatFormat; ``overflow``
    overrides its policy) after every step of ``optimizer`` (any ``torch.optim`` optimizer over float32 or float64
    parameters, or parameters really stored in torch.bfloat16 or torch.float16: :mod:`~lowprec_demo.optim.storage`),
    stored with the remedy of ``rounding``, ``compensation``, ``compensation_format`` and ``master_weights``
    (:mod:`lowprec_demo.optim`). ``generator``: a ``torch.Generator``, or an int seed for a new CPU generator (the same
    seed keeps data-parallel replicas bit-identical); ``rand_bits``: few-bit SR. ``params``: the parameters kept in low
    precision (:func:`select_params`), their optimizer state (Adam's moments) on the grid of ``state_format`` with
    ``state_rounding`` (None: unrounded in float32, or for parameters really stored in bf16 or fp16 their own dtype, as
    torch keeps it); ``round_initial``: round them now, for the first forward pass. ``plan``: a
    :class:`~lowprec_demo.optim.plan.FreezePlan` giving each tensor it names its remedy (leave the remedy arguments and
    ``params`` at their defaults), found by name in ``model`` or, without it, by its recorded position and shape.

    ``param_groups``, ``defaults`` and ``state`` are the inner optimizer's (the same objects), so LR schedulers and
    ``zero_grad`` act on it; hooks registered on this optimizer run around its :meth:`step` and :meth:`state_dict`; its
    ``load_state_dict`` hooks are the inner one's, whose step hooks run once per step. A closure given to :meth:`step`
    is evaluated first, on the stored weights. :meth:`state_dict` holds the wrapper's own state too (Kahan buffers,
    master copies, the generator's): a wrapper loaded from it takes the same steps. Each parameter keeps its own storage
    unless ``pack=True``: then the small float32 ones rounded together live in one flat buffer per run, rounded in one
    call, to the same bits (:mod:`lowprec_demo.common.packing`). FSDP2's sharded parameters store the bits one process
    would (:mod:`lowprec_demo.common.sharding`). torch's Adam(W) on weights stored in bf16 takes the fused step, to the
    same bits (:mod:`~lowprec_demo.optim.fused`): a whole step 1.43-1.58x plain bf16 AdamW's with SR, 2.28-2.39x with
    the remainder (29.4M parameters, ``benchmarks/cpu-2026-12-06-costs.md``); torchao's SR AdamW 4.1-4.7x."""

    def __init__(self, optimizer: torch.optim.Optimizer, fmt: Union[str, FloatFormat], rounding: str = "nearest",
                 generator: GeneratorLike = None, rand_bits: Optional[int] = None, params: ParamSelection = "all",
                 state_format: Union[str, FloatFormat, None] = None, state_rounding: str = "nearest",
                 compensation: Optional[str] = None, overflow: Optional[str] = None, round_initial: bool = True,
                 compensation_format: Union[str, FloatFormat, None] = None, master_weights: bool = False,
                 plan: Optional[FreezePlan] = None, model: Optional[torch.nn.Module] = None,
                 pack: bool = False) -> None:
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
        self.register_state_dict_post_hook(LowPrecisionOptimizer._with_lowprec, prepend=True)
        buffer_format = plan.kahan_format if plan is not None else compensation_format
        self.compensation_format = None if buffer_format is None else get_format(buffer_format)
        all_params = [p for group in optimizer.param_groups for p in group["params"]]
        by_id = None if plan is None else resolve_plan(plan, all_params, model)
        self.lowprec_params = select_params(all_params, params if by_id is None else lambda p: id(p) in by_id)
        self._remedy = {p: self._single if by_id is None else by_id[id(p)] for p in self.lowprec_params}
        self._compensation_buffers, self._masters, self._remainders = {}, {}, {}   # (in state_dict; Kahan's at a step)
        self._check_and_copy(self.lowprec_params)
        if self.params_with("feedback"):
            storage.check_feedback(optimizer)
        self.pack, self.packs = pack, PackCache()    # with pack=True: the buffers the small tensors live in
        self._runs_of: dict = {}
        self._opened: dict = {}     # during a step: the parameters stored in bf16/fp16, with float32 working copies
        self._stored = [p for p in self.lowprec_params if storage.is_stored(p)]
        if round_initial:
            self.round_params()

    def _check_and_copy(self, params: list) -> None:
        """Check new low-precision parameters' dtypes; take their master copies (before any rounding), remainders."""
        for p in params:
            check_param(p, self.fmt, self._remedy[p])
        self._by_remedy = {r: [p for p in self.lowprec_params if self._remedy[p] == r] for r in PLAN_REMEDIES}
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

    def _store(self, tensors: list, fmt: FloatFormat, rounding: str, working: bool = False) -> None:
        """``t.copy_(quantize(t, ...))`` per tensor, one SR seed per run of :func:`~lowprec_demo.common.packing.runs`,
        each element drawing by its index in its run (an FSDP2 piece by its place in the whole tensor). A run of small
        float32 tensors is rounded in one call: on a temporary concatenation, or with ``pack=True`` (not for working
        copies) in their pack's buffer, where they then live."""
        policy = self.overflow if fmt is self.fmt else fmt.overflow
        if self.pack and not working and not any_sharded(tensors):
            layout = self.packs.packs_for(tensors, _packable)
        else:
            layout = self._runs(tensors) if not working else [(members, None) for members in runs(tensors, _packable)]
        for members, pack in layout:
            seed = draw_seed(self.generator) if rounding == "stochastic" else None
            if pack is not None:
                quantize_(pack.flat(members, self.packs.adopted), fmt, rounding, generator=seed,
                          rand_bits=self.rand_bits, overflow=policy)
                pack.put_back(members)      # (nothing to do while they live in the pack)
                continue
            if len(members) > 1 and _packable(members[0]) and not any_sharded(members):
                flat = torch.cat([t.reshape(-1) for t in members])
                quantize_(flat, fmt, rounding, generator=seed, rand_bits=self.rand_bits, overflow=policy)
                copy_into(members, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in members]), members)])
                continue
            start = 0
            for t in members:
                if local_part(t).numel():
                    quantize_(local_part(t), fmt, rounding, generator=seed, rand_bits=self.rand_bits, overflow=policy,
                              index_offset=start + flat_offset(t))
                start += t.numel()

    def _runs(self, tensors: list) -> list:
        """``(members, None)`` per run of ``tensors`` (:func:`~lowprec_demo.common.packing.runs`), cached."""
        key = tuple((id(t), t.numel(), t.dtype) for t in tensors)
        if key not in self._runs_of:
            if len(self._runs_of) >= 16:
                self._runs_of.clear()
            self._runs_of[key] = [(members, None) for members in runs(tensors, _packable)]
        return self._runs_of[key]

    @torch.no_grad()
    def round_params(self, rounding: str = "nearest") -> None:
        """Round the selected parameters onto the grid in place: to nearest, or with
        ``rounding="stochastic"`` drawing from the optimizer's generator (as a step does)."""
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDING_MODES)}; got {rounding!r}")
        self._store([p for p in self.lowprec_params if not storage.is_stored(p)], self.fmt, rounding)

    def held_bytes(self) -> int:
        """The memory kept from step to step beyond the parameters and the inner optimizer's state: Kahan buffers,
        master copies, remainders, and with ``pack=True`` the packs' buffers (none while the tensors live in them)."""
        buffers = [*self._compensation_buffers.values(), *self._masters.values(), *self._remainders.values()]
        return self.packs.held_bytes() + sum(local_part(b).numel() * b.element_size() for b in buffers)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """``closure`` if given (the loss, the gradients of the stored weights), then the inner optimizer's step between
        :meth:`before_inner_step` and :meth:`after_inner_step`; a failed step leaves bf16/fp16 storage as it was."""
        with torch.enable_grad():
            loss = None if closure is None else closure()
        from lowprec_demo.optim import fused       # (loaded at the first step)
        if fused.eligible(self):      # torch's Adam(W), every parameter stored in bf16: the same bits, fused
            return fused.step(self) or loss
        self.before_inner_step()
        try:
            self.optimizer.step()
        except BaseException:
            self._close(keep=False)
            raise
        self.after_inner_step()
        return loss

    def before_inner_step(self) -> None:
        """The parameters stored in bf16/fp16 opened (float32 working copies: :func:`~.storage.open_step`), the master
        copies and the remainders' masters put into the parameters; called without grad by :meth:`step`, or before
        the step of an optimizer the loop steps itself (:func:`~lowprec_demo.monitor.attach_plan`)."""
        self._opened = storage.open_step(self._stored, self.optimizer.state)
        if masters := self.params_with("master"):    # the step starts from the master copy
            torch._foreach_copy_([local_part(p) for p in masters], [local_part(self._masters[p]) for p in masters])
        for p in self.params_with("remainder"):
            storage.join_remainder_(local_part(p.data), local_part(self._remainders[p]))

    def after_inner_step(self) -> None:
        """Every low-precision parameter stored with its remedy, then its elementwise state on the state's grid: those
        stored in bf16/fp16 first, a run of :func:`~lowprec_demo.common.packing.group` at a time (a large tensor
        alone, small ones together; their working copies then put back into storage), then the others."""
        stored = self._stored
        for run in group(stored):
            self._finish({stored[i] for i in run}, working=True)
        self._finish(set(self.lowprec_params).difference(stored), working=False)
        self._close()

    def _close(self, keep: bool = True) -> None:
        opened, self._opened = self._opened, {}
        storage.close_step(opened, self.optimizer.state, self.state_dtype, keep)

    def _finish(self, only: set, working: bool) -> None:
        """The parameters in ``only`` stored with their remedies, then their state (``working``: float32 copies)."""
        with_ = lambda remedy: [p for p in self.params_with(remedy) if p in only]     # noqa: E731
        masters, kahan = with_("master"), with_("kahan")
        if masters:
            torch._foreach_copy_([local_part(self._masters[p]) for p in masters], [local_part(p) for p in masters])
            self._store(masters, self.fmt, "nearest", working)
        for p in with_("remainder"):
            storage.split_remainder_(local_part(p.data), local_part(self._remainders[p]))
        if kahan:
            self.prepare_buffers()
            buffers = [local_part(self._compensation_buffers[p]) for p in kahan]
            work = [b.float() for b in buffers] if working else buffers    # (a bf16 buffer of bf16 storage)
            self._kahan([local_part(p) for p in kahan], work, working)
            if working:
                torch._foreach_copy_(buffers, work)
        if feedback := with_("feedback"):
            intended = [p.detach().clone() for p in feedback]
            self._store(feedback, self.fmt, self.rounding, working)
            storage.feed_back(self.optimizer, feedback, torch._foreach_sub(intended, feedback))
        for rounding in ROUNDING_MODES:
            if members := with_(rounding):
                self._store(members, self.fmt, rounding, working)
        state_format = self.state_format or (self.fmt if working else None)   # stored: as torch keeps it, on the grid
        if state_format is not None and not (working and self._cast_rounds(state_format, only)):
            state = [v for p in self.lowprec_params if p in only for v in storage.elementwise_state(self.optimizer, p)]
            self._store(state, state_format, self.state_rounding, working)

    def _cast_rounds(self, fmt: FloatFormat, stored: set) -> bool:
        """Whether :func:`~.storage.close_step`'s cast of the state is its rounding onto ``fmt`` (nearest, in that
        dtype): rounding first would add two passes for the same bits."""
        native = _native_dtype(torch.empty(0), fmt, self.overflow if fmt is self.fmt else fmt.overflow)
        return self.state_rounding == "nearest" and native is not None and all(
            native == self.state_dtype(self._opened[p].stored) for p in stored)

    def _kahan(self, params: list, buffers: list, working: bool) -> None:
        """Kahan compensation in place: each buffer takes ``p + buf`` (the target), ``p`` the target rounded (the
        stored weight), the buffer the residual (exact), on its own grid if any (small tensors a run in one call)."""
        torch._foreach_add_(buffers, params)
        torch._foreach_copy_(params, buffers)
        self._store(params, self.fmt, "nearest", working)
        torch._foreach_sub_(buffers, params)
        if self.compensation_format is not None:
            self._store(buffers, self.compensation_format, "nearest", True)

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
        grads, groups = [p.grad for p in params], [g for g in self.optimizer.param_groups if "lr" in g]
        lrs = [g["lr"] for g in groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            for g in groups:
                g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
            self._opened = storage.open_step(self._stored, self.optimizer.state)
            self.optimizer.step()   # the inner one: no rounding, no random bits
        finally:
            self._close()
            for p, grad in zip(params, grads):
                p.grad = grad
            for g, lr in zip(groups, lrs):
                g["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:   # (the inner optimizer's)
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

    def _with_lowprec(self, _) -> dict:
        """:meth:`state_dict`: the inner optimizer's plus ``"lowprec"``: the settings, buffers, copies and generator
        state (the first of the state-dict post hooks, so that the hooks registered on this optimizer see it)."""
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
        return state

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        """Registered on the inner optimizer, whose ``load_state_dict`` runs it (``"lowprec"`` in the dict too)."""
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):
        """Registered on the inner optimizer, run once this wrapper's own state is restored."""
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state dict written by :meth:`state_dict` (or a plain inner-optimizer one), through the inner
        optimizer's ``load_state_dict`` and its hooks; then the wrapper's own state, before their post hooks."""
        final = {}      # the dict the pre hooks leave (this one runs after them)
        take = self.optimizer.register_load_state_dict_pre_hook(lambda _, sd: final.update(sd))
        restore = self.optimizer.register_load_state_dict_post_hook(lambda _: self._restore(final), prepend=True)
        try:
            self.optimizer.load_state_dict(state_dict)
        finally:
            take.remove(), restore.remove()

    def _restore(self, state_dict: dict) -> None:
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        self._runs_of.clear()
        _, order, _ = self._param_index()
        for i, saved in state_dict.get("state", {}).items():    # torch casts the state to the parameter's dtype
            p = order[int(i)]
            if p in self._remedy and storage.is_stored(p):
                st = self.optimizer.state[p]
                st.update({k: saved[k].to(device=p.device, dtype=self.state_dtype(p)).clone()
                           for k in storage.elementwise_keys(st, p)})
        if state_dict.get("lowprec") is not None:
            self._load_lowprec(state_dict["lowprec"])
        elif state_dict.get("state") and (lost := [r for r in ("master", "remainder", "kahan") if self.params_with(r)]
                                          + ["SR generator"] * bool(self.generator and self.params_with("stochastic"))):
            warnings.warn(f"load_state_dict: no 'lowprec' part (only the inner optimizer's): the {', '.join(lost)} "
                          f"state is not the saved run's, nor its steps; load this optimizer's state_dict()", None, 4)

    def _load_lowprec(self, extra: dict) -> None:
        saved = extra["format"]
        if any(saved[k] != getattr(self.fmt, k) for k in ("exp_bits", "man_bits", "kind")):
            raise ValueError(f"state dict was saved for format {saved['name']}, this optimizer uses {self.fmt.name}")
        _, order, mine = self._param_index()
        theirs = None if extra.get("plan") is None else {int(i): r for i, r in extra["plan"].items()}
        if theirs != mine:
            raise ValueError("the state dict was saved with a different freeze plan (or with none): build this "
                             "optimizer with the plan it was saved with")
        like = lambda b, t, dtype: b.to(device=t.device, dtype=dtype).clone()   # noqa: E731
        self._compensation_buffers = {order[int(i)]: like(b, order[int(i)], self.buffer_dtype(order[int(i)]))
                                      for i, b in extra.get("compensation_buffers", {}).items()}
        for name, kept in (("master_weights", self._masters), ("remainders", self._remainders)):
            kept.update({order[int(i)]: like(b, kept[order[int(i)]], kept[order[int(i)]].dtype)
                         for i, b in extra.get(name, {}).items() if order[int(i)] in kept})
        if extra.get("generator_state") is not None and isinstance(self.generator, torch.Generator):
            self.generator.set_state(extra["generator_state"])

    def __repr__(self) -> str:
        parts = [self.optimizer.__class__.__name__, f"fmt={self.fmt.name!r}", f"rounding={self.rounding!r}",
                 f"params={len(self.lowprec_params)} tensors", self.pack and "pack=True",
                 self._stored and f"stored={len(self._stored)} tensors in {self._stored[0].dtype}",
                 self.state_format and f"state_format={self.state_format.name!r}",
                 self.compensation and f"compensation={self.compensation!r}",
                 self.compensation_format and f"compensation_format={self.compensation_format.name!r}",
                 self.master_weights and "master_weights=True",
                 self.plan and "plan=" + "/".join(f"{r} {len(self.params_with(r))}" for r in PLAN_REMEDIES
                                                  if self.params_with(r))]
        return f"LowPrecisionOptimizer({', '.join(p for p in parts if p)})"
