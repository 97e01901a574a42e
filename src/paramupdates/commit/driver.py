"""The commit driver: one step's journal applied in the fixed phase order (phase order, rule 4; validated commit, rule 7).

Every way of ending a step commits through :class:`Commit` (``pu.step``,
``Stepper``, ``pu.attach`` and ``Attachment.flush``)::

    c = Commit(journal, optimizer, options, caches, seq)
    c.begin()              # validate: hide the overlay, sync, finiteness; False: skip the step (host verdict)
    c.before_optimizer()   # the rules' checks (before any write), then phase before_grad
    c.run_optimizer()      # phase grad: optimizer.step()   (or c.optimizer_stepped() under attach)
    c.finish()             # after_grad, auxiliary, after_step
    c.abort(exc)           # on any exception: restore (copy_for_rollback) or keep what was written

:meth:`Commit.run` is that sequence. With a closure (``optimizer.step(closure)``:
LBFGS, Lightning's automatic optimization) the gradients exist only once the
optimizer has called the closure, so :meth:`Commit.wrap_closure` runs ``begin``
and ``before_optimizer`` right after the closure's first call returns, before
the optimizer uses the gradients: ``before_grad`` rules (weight decay, and
which parameters it decays) see this step's gradients, as ``AdamW`` does.

The verdict of ``on_nonfinite="skip"`` (and of a ``scaler=``) is taken on the device where every writer
can take it (:meth:`Commit._decides_on_device`): ``begin`` then returns True with ``Commit.ok``, a 0-dim
bool tensor never read on the host, under which every phase applies (the rules through
``CommitContext.ok``, the pending values selected by ``ops.select_``, the optimizer through
``found_inf``, its kernel's skip). A skipped step so decided leaves everything bitwise as before it,
as the host's skip does.

Validation before the first write: shape, dtype kind and device are checked
when an update is issued; at :meth:`Commit.begin` synced values are reduced
and every pending value is checked for finiteness in one batched reduction;
:meth:`Commit.before_optimizer` runs every declared rule's check. Only then is
anything written. In each phase: the declared rules (declaration order), then
the recorded updates (issue order). A target whose updates all lie in one
phase and that nothing else wrote before that phase takes its pending value
as is: one ``torch._foreach_copy_`` per device and dtype. Other targets fold
their records, in issue order, over the value the target has when their
phase comes.

An exception after the first write (from the optimizer's step, or a rule that
runs user code) leaves, by default, what was written so far, as plain PyTorch
leaves what an optimizer wrote before it raised; the rest of the step is
discarded and a note on the exception says which phases were applied. With
``copy_for_rollback=True`` (``rollback.Rollback``) what a stage writes while a
fallible stage is still to come is copied first, so that the exception
restores everything bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .. import accounting, hooks, overlay, sharding, state
from ..errors import UpdateError, listed
from ..ops import apply_op, select_
from ..phases import AFTER_OPTIMIZER, AFTER_STEP, AUXILIARY, BEFORE_GRAD, GRAD, PHASES
from ..records import Entry
from ..rules.base import CommitContext, Rule, rules_for
from ..schedule import Schedule, ScheduleEntry
from .finite import device_flag, finite_flag, nonfinite, on_one_device, optimizer_grads, pending_values
from .rollback import Rollback

if TYPE_CHECKING:
    from ..journal import Journal
    from ..options import StepOptions


class Commit:
    """One commit of one journal (see the module docstring for the sequence)."""

    def __init__(
        self,
        journal: Journal,
        optimizer: torch.optim.Optimizer | None,
        options: StepOptions,
        caches: Any,  # owner.Caches (or None): the ruleset and the rollback pool of (model, optimizer)
        seq: int,
    ) -> None:
        self.journal = journal
        self.optimizer = optimizer
        self.optimizer_name = type(optimizer).__name__ if optimizer is not None else None  # (the schedule's)
        self.options = options
        self.label = journal.label
        self.seq = (
            seq  # the owner's count of closed steps: ranks check they commit the same one (distributed sync, rule 9)
        )
        self.ruleset = caches.ruleset if caches is not None else None
        self.rollback = Rollback(options.copy_for_rollback, caches.pool if caches is not None else None)
        self._applied: list[str | Rule] = []  # what was written so far, for the note on an exception
        self.rules: list[Rule] = []
        self._phase_rules: dict[str, list[Rule]] = {}  # the rules by phase, in declaration order
        self._ctx: CommitContext | None = None  # what the rules see (one per commit)
        # The GradScaler whose verdict on the gradients this commit takes (``scaler=``), and, under
        # pu.attach, the optimizer as given to the scaler's step that is running this commit (None:
        # the commit calls scaler.step and scaler.update itself, as pu.step's does).
        self.scaler: Any = options.scaler
        self.scaler_opt: Any = None
        self.skipped = False  # the step was dropped, as decided on the host
        # The step's verdict where it is taken on the device (``on_nonfinite="skip"``, a scaler's overflow,
        # when every writer can take it: :meth:`_decides_on_device`): a 0-dim bool tensor, never read here,
        # under which every phase applies (False: everything stays bitwise as it was). None: decided on
        # the host, or nothing to decide.
        self.ok: torch.Tensor | None = None
        self._closure = False  # optimizer.step(closure): the checks run inside the closure (host verdict)
        self._lent_flag: tuple[Any, Any] | None = None  # (optimizer, its found_inf before ours) while lent
        self.state = "new"  # new -> begun -> checked -> stepped -> done | aborted
        # The entries whose targets were written earlier in this commit (by a phase or a rule: what
        # the optimizer writes is trainable, see run_phase). Rules' tensors are added only when a
        # phase has recorded entries to classify, so rules over many tensors cost nothing here.
        self._dirty: set[int] = set()
        self._dirty_pending: list[list[torch.Tensor]] = []
        self._hidden_grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    # ------------------------------------------------------------------
    # the sequence
    # ------------------------------------------------------------------
    def run(self, closure: Callable[[], Any] | None = None) -> Any:
        """The whole commit; returns what ``optimizer.step`` returned. :meth:`abort` on any exception."""
        try:
            if closure is not None and self.optimizer is not None:
                out = self.run_optimizer(self.wrap_closure(closure))
                if self.skipped:
                    return None
            else:
                if not self.begin():
                    return None
                self.before_optimizer()
                out = self.run_optimizer()
            self.finish()
        except BaseException as exc:
            self.abort(exc)
            raise
        return out

    def begin(self) -> bool:
        """Stop showing pending values, refuse what cannot commit, take the rules, reduce synced values,
        check finiteness (where asked). False: skip this step. Every check runs before any write."""
        j = self.journal
        j.state = "committing"
        j.hide()
        self.state = "begun"
        self._refuse_unwritable()
        self._take_rules()
        if self.options.on_nonfinite is None and self.scaler is None and not j.synced and j.sharding() is None:
            return True  # the default commit: no verdict to take, nothing to agree on with other ranks
        return self._take_verdict()

    def _take_verdict(self) -> bool:
        """The step's verdict (``on_nonfinite``, a scaler's overflow, the other ranks' values): on the device
        where every writer can take it (:meth:`_decides_on_device`), else on the host. False: skip the step."""
        j = self.journal
        if self._decides_on_device():
            self._gate()
            return True
        if self._scaler_overflowed():
            # a scaled gradient overflowed: the scaler's business (torch.amp.GradScaler semantics)
            self.skipped = True
            self._end("done")
            self._scaler_done()
            return False
        params, grads = self._grads_to_check()
        sharded = j.any_sharded or (bool(grads) and sharding.any_sharded(grads))
        remote_bad, agreed = self._reduce_synced(grads, sharded)
        remote_bad = self._agree_sharded(grads, sharded, remote_bad, agreed)
        if self.options.checks_finite:
            return self._decide_finite(params, grads, sharded, remote_bad)
        return True

    def _refuse_unwritable(self) -> None:
        """A model on the meta device, or targets converted or replaced while their updates were
        pending: nothing of the step can be written."""
        j = self.journal
        if j.index.has_meta and j.index.meta_names():
            names = j.index.meta_names()
            self._end("aborted")
            raise UpdateError(
                f"{self.label}: {listed(list(map(repr, names)))} "
                f"of {type(j.index.model).__name__} {'is' if len(names) == 1 else 'are'} on the meta device: no "
                "values to update or step. Materialize the model first (model.to_empty(device=...) and initialize "
                "it, or load_state_dict(..., assign=True)). Nothing was written."
            )
        changed = j.check_storage()
        if changed:
            self._end("aborted")
            raise UpdateError(
                f"{self.label}: {'; '.join(changed)} while updates to it were pending in this step "
                "(model.to(), .half(), .cuda(), to_empty(), or .data = ... inside the step). Nothing of "
                "the step was written; the model keeps the conversion, applied to the stored values. "
                "Convert the model between steps: before the first update of a step, or after its commit."
            )

    def _take_rules(self) -> None:
        """The rules of this commit (the model's; without an optimizer, only those that run in every
        committed step) and what rollback keeps of them."""
        rules = rules_for(self.journal.index, self.optimizer)
        if self.optimizer is None:
            # rules that belong to the gradient update run once per real optimizer update (read-your-writes, rule 1)
            rules = [r for r in rules if not r.per_optimizer_update]
        self.rules = rules
        if self.optimizer is not None and state.process.optimizer_watch is not None:
            accounting.applied(self.optimizer, rules)  # (rule 12: the optimizer step's rules are these)
        fallible = 1 if self.optimizer is not None else 0
        if rules:
            by_phase: dict[str, list[Rule]] = {}
            for r in rules:
                by_phase.setdefault(r.phase, []).append(r)
                fallible += not r.infallible
            self._phase_rules = by_phase
            self.rollback.save_rules(rules)
        self.rollback.fallible_left = fallible

    def _decides_on_device(self) -> bool:
        """Whether this step's verdict (``on_nonfinite="skip"``; with a scaler, its overflow) is taken on
        the device, with no host sync: every writer of the step can apply under a device flag. The
        optimizer takes it in its kernel (:func:`takes_found_inf`), the declared rules honour it
        (:attr:`Rule.gates`), the pending values are selected (``where``). Else the host decides, with one
        sync: ``"raise"`` (the host must raise), a closure (the checks run inside ``optimizer.step``),
        ``sync=`` updates and sharded models (the ranks agree through the host), an optimizer without
        ``found_inf`` in its kernel, a rule that does not gate (an EMA warmup, a user rule)."""
        opts = self.options
        if opts.on_nonfinite == "raise" or (opts.on_nonfinite is None and self._scaler() is None):
            return False
        j = self.journal
        if self._closure or j.synced or j.any_sharded:
            return False
        if self.optimizer is not None and not takes_found_inf(self.optimizer):
            return False
        if not all(r.gates for r in self.rules):
            return False
        support = hooks.sharding_support()
        return support is None or not support.model_sharded(j.index)

    def _gate(self) -> None:
        """Take the step's verdict on the device: ``ok`` = nothing the scaler (or a ``found_inf`` already
        on the optimizer) found, and (``on_nonfinite="skip"``) every pending value and gradient finite, in
        one fused check (``finite.device_flag``). Nothing is read on the host; every phase applies
        under ``ok``, and the optimizer takes ``~ok`` as its ``found_inf`` (:meth:`optimizer_starting`)."""
        ok = None
        if self.options.checks_finite:
            _params, grads = self._grads_to_check()
            ok = device_flag(pending_values(self.journal), False, grads)
        found = self._found_inf()
        if found is not None:
            clean = found == 0
            ok = clean if ok is None else torch.logical_and(*on_one_device([ok, clean]))
        self.ok = ok
        if self._ctx is not None:
            self._ctx.ok = ok

    def _found_inf(self) -> torch.Tensor | None:
        """The scaler's verdict on the gradients, on the device (no host read): under ``pu.step`` the
        commit unscales (``scaler.unscale_``, as before) and sums its ``found_inf``; inside
        ``scaler.step`` (``pu.attach``) the scaler has set ``found_inf`` on the optimizer, as a
        ``found_inf`` already there is taken whoever set it (the kernel would take it too)."""
        scaler = self._scaler()
        if scaler is not None and self.scaler_opt is None:
            opt = self.optimizer
            state = scaler._per_optimizer_states[id(opt)]
            if state["stage"] is OptState.READY:
                scaler.unscale_(opt)
            found = list(state["found_inf_per_device"].values())
            if not found:  # (no gradients: nothing found; scaler.update() says so, as after scaler.step)
                return None
            return found[0] if len(found) == 1 else torch.stack(on_one_device(found)).sum()
        holder = self.scaler_opt if self.scaler_opt is not None else self.optimizer
        return None if holder is None else vars(holder).get("found_inf")

    def _grads_to_check(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The parameters and gradients the optimizer will use, when finiteness is checked: they are
        checked with the pending values (validated commit, rule 7), as ``torch.amp.GradScaler`` does."""
        if self.options.checks_finite and self.optimizer is not None and self._scaler() is None:
            return optimizer_grads(self.optimizer)
        return [], []  # (with a scaler, its found_inf decided: no second check)

    def _reduce_synced(self, grads: list[torch.Tensor], sharded: bool) -> tuple[int, bool]:
        """Rule 9: reduce the synced values across ranks; the other ranks' finiteness of their unsynced
        values rides along, so all ranks decide alike. Returns (ranks with non-finite values, whether
        every rank of the group learnt that number)."""
        j, opts = self.journal, self.options
        synced = j.synced
        if not synced:
            return 0, False
        backend = hooks.sync_backend(self.label)
        backend.check_rules(self, synced)
        if not backend.active(opts.process_group):
            return 0, False
        local_bad = False
        if opts.checks_finite:
            ok = finite_flag(pending_values(j, unsynced=True), sharded, grads)
            local_bad = ok is not None and not bool(ok)
        remote_bad = backend.reduce(self, synced, local_bad)
        return remote_bad, opts.process_group is None and any(not e.sharded for e in synced)

    def _agree_sharded(self, grads: list[torch.Tensor], sharded: bool, remote_bad: int, agreed: bool) -> int:
        """Sharding hook: the ranks of a sharded model hold one model between them, so they skip or raise
        together (one small all-reduce, unless the sync carried it), and no write may go into a
        parameter whose memory FSDP has freed."""
        j = self.journal
        if not (j.entries or j.loose) or j.sharding() is None:
            return remote_bad
        self._guard_storage()
        if self.options.checks_finite and not agreed:
            ok = finite_flag(pending_values(j), sharded, grads)
            remote_bad = hooks.sharding_support().agree_nonfinite(self, ok is not None and not bool(ok))  # type: ignore[union-attr]
        return remote_bad

    def _decide_finite(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], sharded: bool, remote_bad: int
    ) -> bool:
        """The finiteness check (one batched reduction, one host sync): True to go on; False to skip
        the step; or an :class:`UpdateError` naming the non-finite targets or gradients."""
        j, opts = self.journal, self.options
        if opts.on_nonfinite == "skip":  # the verdict only: one read, no names
            ok = finite_flag(pending_values(j), sharded, grads)
            if (ok is None or ok) and not remote_bad:
                return True
            self.skipped = True
            self._end("done")
            self._scaler_done()
            return False
        bad, bad_grads = nonfinite(j, grads, sharded)
        if not (bad or bad_grads or remote_bad):
            return True
        self._end("aborted")
        if not bad and not bad_grads:
            raise UpdateError(
                f"{self.label}: {remote_bad} other rank(s) have non-finite pending values in this "
                "step (see their error). Nothing was written on any rank. Fix the value, or pass "
                "on_nonfinite='skip' to drop such steps (they are counted, on every rank alike)."
            )
        if bad:
            lines = listed([f"{e.name!r} (last update at {e.records[-1].origin})" for e in bad], 5, "; ")
            raise UpdateError(
                f"{self.label}: non-finite pending value for {lines}. Nothing was written. "
                "Fix the value, or pass on_nonfinite='skip' to drop such steps (they are counted)."
            )
        names = listed([repr(self._param_name(params[i])) for i in bad_grads], 5)
        raise UpdateError(
            f"{self.label}: non-finite gradient of {names}, which "
            f"{type(self.optimizer).__name__}.step() would write into the parameter. Nothing was "
            "written. Fix the loss, the data or the learning rate; or pass on_nonfinite='skip' to skip "
            "such steps as torch.amp.GradScaler does (the whole step, counted in skipped_steps); or "
            "leave on_nonfinite=None (the default) to let the optimizer take them, as plain PyTorch does."
        )

    def _scaler(self) -> Any:
        """The step's ``torch.amp.GradScaler``, if it has an enabled one and an optimizer."""
        scaler = self.scaler
        if scaler is None or self.optimizer is None or not scaler.is_enabled():
            return None
        return scaler

    def _scaler_overflowed(self) -> bool:
        """With a ``scaler=``: whether the scaled gradients overflowed, as the scaler itself decides.

        Under ``pu.step``: ``scaler.unscale_(optimizer)``, then its ``found_inf`` (one host sync, the
        one ``scaler.step`` makes anyway; ``scaler.step`` then reuses the unscaled gradients). Under
        ``pu.attach`` the commit runs inside ``scaler.step``, which calls ``optimizer.step()`` only
        when nothing overflowed, except for an optimizer that takes ``found_inf`` into its own kernel
        (``fused=True``): then its ``found_inf`` is read (one host sync)."""
        scaler = self._scaler()
        if scaler is None:
            return False
        running = self.scaler_opt is not None
        opt = self.scaler_opt if running else self.optimizer
        if running and not getattr(opt, "_step_supports_amp_scaling", False):
            return False
        state = scaler._per_optimizer_states[id(opt)]
        if not running and state["stage"] is OptState.READY:
            scaler.unscale_(opt)
        return bool(sum(v.item() for v in state["found_inf_per_device"].values()))

    def _scaler_done(self) -> None:
        """Under ``pu.step(scaler=)`` the commit drives the scaler: a step that ends without the optimizer's
        update (skipped, or an exception after the commit unscaled) still ends the scaler's iteration with
        ``scaler.update()``, as ``scaler.step`` then ``scaler.update`` do in a plain GradScaler loop (the
        scale backs off after an overflow; ``scaler.step`` is not called: it would read ``found_inf`` on
        the host a second time). Otherwise the scaler would keep this step's gradients as unscaled, and
        the next step would take its scaled gradients for unscaled ones."""
        scaler = self._scaler()
        if scaler is None or self.scaler_opt is not None:
            return
        state = scaler._per_optimizer_states.get(id(self.optimizer))
        if state is not None and state["stage"] is not OptState.READY:
            scaler.update()

    def _param_name(self, p: torch.Tensor) -> str:
        """``p``'s qualified name in the model, or where the optimizer holds it."""
        name = self.journal.index.name_of(p)
        if name is not None:
            return name
        for gi, g in enumerate(self.optimizer.param_groups):  # type: ignore[union-attr]
            for pi, q in enumerate(g["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{pi}] (not a parameter of the model)"
        return "<a parameter>"

    def _guard_storage(self) -> None:
        """Refuse the commit (before any write) if a target's memory does not cover it: FSDP frees its
        unsharded parameters by resizing their storage to 0 bytes, and a write there would be a write
        into freed memory."""
        j = self.journal
        if any(not sharding.storage_ok(t) for rec in j.loose for t in rec.targets):  # type: ignore[union-attr]
            j.settle()  # name the target below
        for e in j.entries.values():
            if not sharding.storage_ok(e.target):
                self._end("aborted")
                raise UpdateError(
                    f"{self.label}: {e.name!r} (last update at {e.records[-1].origin}) has no memory behind it "
                    f"any more (its storage holds {sharding.local(e.target).untyped_storage().nbytes()} bytes): it "
                    "is a temporary parameter that its owner freed, e.g. FSDP's unsharded parameter after "
                    "forward/backward. Update the sharded parameter from outside forward (phase='before_grad' or "
                    "'after_grad'), or keep such state in a buffer. Nothing was written."
                )

    def before_optimizer(self) -> None:
        """Check every declared rule (before any write), then apply phase ``before_grad``."""
        j = self.journal
        if self.rules and j.loose:
            # a loose record's target written by a rule before its phase folds like any entry's: settle
            written = {id(t) for r in self.rules if r.phase != AFTER_STEP for t in r.tensors()}
            if any(id(t) in written for rec in j.loose for t in rec.targets):  # type: ignore[union-attr]
                j.settle()
        if self.rules:
            ctx = self._context()
            if self.ruleset is not None:
                self.ruleset.check(self.rules, ctx)
            else:
                for rule in self.rules:
                    rule.check(ctx)
        self.state = "checked"
        if BEFORE_GRAD in self._phase_rules or BEFORE_GRAD in j.by_phase:
            self.run_phase(BEFORE_GRAD)
        else:
            j.done_phases.add(BEFORE_GRAD)  # (nothing to apply)

    def _context(self) -> CommitContext:
        """What the rules of this commit see (made once)."""
        if self._ctx is None:
            self._ctx = CommitContext(self.optimizer, self.journal.index, self.journal, self.rules)
            self._ctx.ok = self.ok
        return self._ctx

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` for ``optimizer.step``: after its first call (the gradients exist) the commit
        begins and applies ``before_grad``, before the optimizer uses the gradients."""

        def closure_then_commit() -> Any:
            loss = closure()
            if self.state == "new":
                self._closure = True
                if self.begin():
                    with torch.no_grad():
                        self.before_optimizer()
                    self.journal.show_pending()  # later closure calls (LBFGS) read the pending values (read-your-writes, rule 1)
                else:
                    self.hide_grads()
            return loss

        return closure_then_commit

    def run_optimizer(self, closure: Callable[[], Any] | None = None) -> Any:
        """Phase ``grad``: ``optimizer.step()`` (``closure``: a :meth:`wrap_closure`)."""
        out = None
        opt = self.optimizer
        if opt is not None:
            if self.rollback.enabled:
                self.rollback.protect_optimizer(opt, all_params=closure is not None)
            self.optimizer_starting()
            scaler = self._scaler() if self.scaler is not None else None
            running = state.local.committing  # (the commits of this thread running optimizer.step())
            running.append(self)  # this commit runs opt.step(): an attachment on that optimizer stands aside
            try:
                if scaler is not None:  # (no closure: refused with a scaler)
                    # the scaler's verdict is taken (begin): on the host (no overflow: a step with one was
                    # dropped), or on the device (lent to the kernel as found_inf). What scaler.step would
                    # add is a second read of found_inf on the host: the optimizer steps, the scale updates.
                    out = opt.step()
                    scaler.update()
                else:
                    out = opt.step() if closure is None else opt.step(closure)
            finally:
                running.remove(self)
            if closure is not None:
                self.journal.hide()
                if self.state == "new":
                    raise UpdateError(
                        f"{self.label}: {type(opt).__name__}.step(closure) returned without calling the closure, "
                        "so this step's updates and rules could not run after the gradients were computed. "
                        "Call optimizer.step() without a closure, or use an optimizer that calls it."
                    )
                if self.skipped:
                    self.restore_grads()
                    return out
        self.optimizer_stepped()
        return out

    def optimizer_starting(self) -> None:
        """The optimizer's step is about to run (what it writes stays if it raises, unless copied). Under
        a device verdict, the optimizer takes it as ``found_inf`` (GradScaler's attribute; 1.0: its
        kernel writes nothing), lent for this step: :meth:`_optimizer_done` puts back what was there."""
        opt = self.optimizer
        self._applied.append(f"{type(opt).__name__}.step (started)")
        if self.ok is not None and opt is not None and self._lent_flag is None:
            self._lent_flag = (opt, vars(opt).get("found_inf", _MISSING))
            opt.found_inf = (~self.ok).to(torch.float32)  # type: ignore[attr-defined]  # (GradScaler's attribute)

    def optimizer_stepped(self) -> None:
        """The optimizer's step is behind us (called by :meth:`run_optimizer`, or under attach by the
        optimizer's post-hook)."""
        if self.rules or self._lent_flag is not None:
            self._optimizer_done()
        if self.optimizer is not None:
            self.rollback.stage_done(True)
        self.journal.done_phases.add(GRAD)
        self.state = "stepped"

    def _optimizer_done(self) -> None:
        """What the rules and the verdict lent the optimizer for its step goes back (after it, or after a
        failure)."""
        for rule in self.rules:
            rule.optimizer_done()
        lent, self._lent_flag = self._lent_flag, None
        if lent is not None:
            opt, before = lent
            if before is _MISSING:
                vars(opt).pop("found_inf", None)
            else:
                opt.found_inf = before

    def finish(self) -> None:
        """Phases ``after_grad``, ``auxiliary`` and ``after_step``; the commit is done."""
        j = self.journal
        if j.shown:  # (shown again by the optimizer's step: a closure's forward)
            j.hide()
        for phase in AFTER_OPTIMIZER:
            if phase in self._phase_rules or phase in j.by_phase or (j.loose and phase == AUXILIARY):
                self.run_phase(phase)
            else:
                j.done_phases.add(phase)  # (nothing to apply: run_phase would only say so)
        self._end("done")

    def abort(self, exc: BaseException | None = None) -> None:
        """End a failed commit: drop what is pending; restore what was written (``copy_for_rollback``),
        or keep it and say so on ``exc``."""
        self.journal.hide()
        self.restore_grads()
        self._optimizer_done()
        self._scaler_done()
        if self.state in ("begun", "checked", "stepped"):
            if self.rollback.enabled:
                self.rollback.restore()  # the copies, the optimizer's state, the rules' state
            else:
                self.rollback.release()  # rules that did not run let go of what their checks held
                if exc is not None and self._applied:
                    exc.add_note(self._what_was_applied())
        if self.state not in ("done", "aborted"):
            self._end("aborted")

    def _what_was_applied(self) -> str:
        done = ", ".join(a if isinstance(a, str) else f"{a.kind} (declared at {a.origin})" for a in self._applied)
        left = [p for p in PHASES if p not in self.journal.done_phases and p != GRAD]
        return (
            f"paramupdates ({self.label}): the commit had applied {done} when this was raised; that stays "
            "written, as plain PyTorch keeps what an optimizer wrote before raising. The rest of the step "
            f"({', '.join(left)}) was discarded. To have such a step restored bitwise instead, pass "
            "copy_for_rollback=True (one copy of the parameters and optimizer state per step)."
        )

    def release(self) -> None:
        """The commit is over and only its schedule is kept (``schedule()``, made when first read): let go
        of the optimizer, so that the plan of a forgotten attachment's last step keeps it alive no longer
        than the attachment itself does (weakly)."""
        self.optimizer = None
        self.journal.optimizer = None
        self._ctx = None

    def skip(self) -> None:
        """Drop the step whole, writing nothing (the scaler skipped ``optimizer.step()``): its pending
        updates are discarded and no rule runs; counted as a skipped step."""
        j = self.journal
        j.state = "committing"
        j.hide()
        self.skipped = True
        self._end("done")

    def _end(self, state: str) -> None:
        self.state = state
        self.journal.close()
        if self.rollback.enabled:  # (without copies it kept nothing to let go of)
            self.rollback.end()

    # ------------------------------------------------------------------
    # skipped steps under a closure or an attachment: the optimizer runs, but sees no gradients
    # ------------------------------------------------------------------
    def hide_grads(self) -> None:
        saved = []
        for g in self.optimizer.param_groups:  # type: ignore[union-attr]
            for p in g["params"]:
                saved.append((p, p.grad))
                p.grad = None
        self._hidden_grads = saved

    def restore_grads(self) -> None:
        if self._hidden_grads is not None:
            for p, grad in self._hidden_grads:
                p.grad = grad
            self._hidden_grads = None

    # ------------------------------------------------------------------
    # the plan
    # ------------------------------------------------------------------
    def schedule(self) -> Schedule:
        """The plan of this commit (made when first read)."""
        return Schedule.later(self._rows)

    def _rows(self) -> list[ScheduleEntry]:
        rows: list[ScheduleEntry] = []
        index = self.journal.index
        order = list(self.journal.order)
        for phase in PHASES:
            if phase == GRAD:
                if self.optimizer_name is not None:
                    rows += optimizer_rows(self.optimizer_name, self.label)
                continue
            for rule in self.rules:
                if rule.phase == phase:
                    rows.extend(rule.rows(index))
            for r in order:
                if r.phase != phase:
                    continue
                cond = "-" if r.cond is None else "when(tensor)"
                sync = f" sync={r.sync}" if r.sync else ""
                origin = str(r.origin)
                rows += [ScheduleEntry(phase, name, op + sync, cond, origin) for name, op in zip(r.names(), r.ops)]
        return rows

    # ------------------------------------------------------------------
    # a phase
    # ------------------------------------------------------------------
    def run_phase(self, phase: str) -> None:
        """Apply one phase: its declared rules, then its recorded updates (see the module docstring)."""
        rb, j = self.rollback, self.journal
        if rules := self._phase_rules.get(phase):
            self._apply_rules(rules)
        in_phase = j.by_phase.get(phase, ())
        loose = phase == AUXILIARY and bool(j.loose)  # (their targets have this phase alone, nothing wrote them)
        if not in_phase and not loose:
            j.done_phases.add(phase)
            return
        if self._dirty_pending:
            self._flush_dirty()
        dirty = self._dirty
        # A target updated in this phase alone, that nothing wrote before, takes its pending value as
        # is: every target, when nothing in this commit or journal can have made one stale. (A synced
        # target, rule 9, commits its reduced value: it has one phase, is not trainable and no rule
        # writes it, as checked before.)
        every = not dirty and phase not in j.mixed and not j.any_sharded
        later = phase != BEFORE_GRAD and GRAD in j.done_phases  # the optimizer may have written trainables
        fast_dst: list[torch.Tensor] = j.loose_dst[:] if loose else []
        fast_src: list[torch.Tensor] = j.loose_src[:] if loose else []
        slow: list[Entry] = []
        for e in in_phase:
            if (
                every
                or e.sync is not None
                or (len(e.phases) == 1 and not (dirty and id(e) in dirty) and not (later and e.trainable))
            ):
                fast_dst.append(e.raw if e.raw is not None else _raw(e))
                fast_src.append(sharding.local(e.value) if e.sharded else e.value)  # type: ignore[arg-type]
            else:
                slow.append(e)
        if rb.enabled:
            rb.protect(fast_dst + [_raw(e) for e in slow])
        ok = self.ok
        with no_grad():
            if fast_dst:
                if ok is None:
                    copy_pairs(fast_dst, fast_src)
                else:
                    select_(ok, fast_dst, fast_src)
            for e in slow:
                raw = _raw(e)
                val: torch.Tensor = e.target.detach() if e.sharded else raw  # a DTensor folds as one
                for r in e.records:
                    if r.phase == phase:
                        # the operands as issued (ops.as_issued); val is never written: no copy of them
                        k = 0 if len(r.ops) == 1 else r.entries.index(e)  # (identity: Entry has eq=False)
                        val = apply_op(r.ops[k], val, r.operands[k], r.key, r.cond, True)  # type: ignore[index]
                if ok is not None:
                    select_(ok, [raw], [val])
                else:
                    raw.copy_(sharding.local(val) if e.sharded else val)  # shard onto shard (placed alike)
        dirty.update(map(id, in_phase))  # (ids of entries, not targets: see _flush_dirty)
        j.done_phases.add(phase)
        self._applied.append(f"the {phase} updates")

    def _apply_rules(self, rules: list[Rule]) -> None:
        """Apply a phase's declared rules, in declaration order (their checks ran before any write). What a
        rule writes is listed only where it is needed: to copy it first (rollback), or to classify the
        recorded updates of a later phase (no Python work per tensor otherwise)."""
        rb = self.rollback
        ctx = self._ctx if self._ctx is not None else self._context()  # (made by the checks, before any write)
        copies = rb.needs_copies()
        listed = copies or bool(self.journal.entries)
        with no_grad():
            for rule in rules:
                if listed:
                    written = rule.tensors()
                    if copies:
                        rb.protect(written)
                    self._dirty_pending.append(written)
                rule.apply(ctx)
                rb.applied(rule)
                self._applied.append(rule)
                if not rule.infallible:
                    rb.stage_done(True)  # (an infallible rule is no stage that lowers the count)

    def _flush_dirty(self) -> None:
        """Add the entries whose targets the rules so far wrote to ``_dirty`` (as the ids of the entries)."""
        if not self._dirty_pending:
            return
        entries = self.journal.entries
        for ts in self._dirty_pending:
            for t in ts:
                e = entries.get(id(t))
                if e is not None and e.target is t:
                    self._dirty.add(id(e))
        self._dirty_pending.clear()


def optimizer_rows(optimizer_name: str, label: Any) -> list[ScheduleEntry]:
    """The schedule's row of the gradient update (phase ``grad``) of a step labelled ``label``."""
    return [ScheduleEntry(GRAD, "<optimizer parameters>", f"{optimizer_name}.step", "-", str(label))]


class _NoGrad:
    """``torch.no_grad()`` for one phase of an eager commit, without its decorator machinery (0.3 us
    instead of 1.4: a commit enters it once per phase with work, every step)."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: Any) -> None:
        torch._C._set_grad_enabled(self.prev)


def no_grad() -> Any:
    """A context in which autograd records nothing: :class:`_NoGrad` eagerly, ``torch.no_grad()``
    while dynamo traces (a traced commit: it knows that one)."""
    return torch.no_grad() if torch.compiler.is_compiling() else _NoGrad()


def copy_pairs(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i] <- src[i]`` for every ``i``, whatever their devices and dtypes.

    On CPU one ``torch._foreach_copy_`` over all of them: its CPU kernel copies pair by pair
    (``Tensor.copy_``, any dtypes), so grouping by device and dtype first would only add a pass over
    the tensors (37 us for 150 pairs, more than the copies of 150 small statistics). Elsewhere one call
    per device and dtype: the one-launch path of an accelerator needs a single device and dtype.
    (Decided by the first target: a list that starts on CPU and goes on elsewhere is still copied
    right, pair by pair.)"""
    if len(dst) == 1:
        dst[0].copy_(src[0])
    elif dst[0].is_cpu:
        torch._foreach_copy_(dst, src)
    else:
        for _k, ([d, s], _) in _group_tensors_by_device_and_dtype([dst, src]).items():
            torch._foreach_copy_(d, s)


def _raw(e: Entry) -> torch.Tensor:
    """``e``'s target as a plain tensor to write into (made once per entry)."""
    raw = e.raw
    if raw is None:
        if e.sharded:  # a DTensor is written through its local shard (sharding hook)
            raw = e.raw = sharding.local(e.target)
        else:
            raw = e.raw = e.target if type(e.target) in _PLAIN else overlay.plain(e.target).detach()
    return raw


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_MISSING = object()


def takes_found_inf(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` takes a step's verdict in its kernel, as ``torch.amp.GradScaler`` hands it
    over: ``optimizer.found_inf`` (nonzero: the kernel writes nothing), for the optimizers that set
    ``_step_supports_amp_scaling`` (torch's ``fused=True`` Adam, AdamW, SGD, Adagrad). Not torch's fused
    SGD with momentum before its first step: on a skipped first step its kernel leaves the momentum
    buffers it makes uninitialised (``torch.empty_like``), so that step is decided on the host."""
    if not getattr(opt, "_step_supports_amp_scaling", False):
        return False
    if isinstance(opt, torch.optim.SGD):
        state = opt.state
        for g in opt.param_groups:
            if g.get("momentum", 0) and not any("momentum_buffer" in state.get(p, ()) for p in g["params"]):
                return False
    return True
