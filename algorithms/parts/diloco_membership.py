"""DiLoCo's side of fault tolerance (``DistributedModel(..., fault_tolerant=True)``): where the survivors of a
lost peer stand relative to the sync in progress, and how :meth:`DiLoCoMembership.heal` brings them
together; what a joiner takes. Its counters (``_syncing``, ``_syncs``, ``_merges``) are kept by
:class:`~bagua_lite.algorithms.diloco.DiLoCo`'s steps."""
from bagua_lite.membership import broadcast_state

from .streaming import Background


class DiLoCoMembership:
    """Mixed into :class:`~bagua_lite.algorithms.diloco.DiLoCo` (and so local SGD)."""

    #: fault tolerance: any options (syncs in the step or in the background, dense or compressed)
    supports_membership_change = True

    @property
    def store_admission_margin(self):
        """With ``overlap`` no collective of the training thread carries the news of a joiner: rank 0 posts the
        step to admit it at, further ahead than any member can be (a rank runs at most until the next merge,
        which waits for every rank to have started that sync: a period plus the overlap)."""
        return self.period + self.overlap + 2 if self.overlap else None

    #: a lost peer is healed by :meth:`heal` (the survivors may be at different steps: one that completed
    #: the sync goes on with local steps until it looks at the store)
    heals_itself = True

    def heal(self):
        """After a lost peer, on the survivors' new group (a collective). Each survivor is in one of three
        places: it completed the last sync (its result holds every worker's pseudo-gradient, the lost one's
        too), it is inside that sync (it failed there; its state is as before the sync: the sync writes the
        weights, anchors and outer state only once its allreduce completed), or before it (it learned of the
        loss from the store in its local steps). If any completed it, the others take its state: weights,
        inner optimizer state, anchors, outer optimizer state, step count. Otherwise every survivor goes to
        the sync's step count (one before it skips its remaining local steps: at most the round in
        progress) and they finish the sync among themselves. A failure in the dense warm-up is the
        synchronous case: nothing to heal.

        With a ``compression`` each rank's error-feedback residual is its own: it is never sent. A completed
        sync took every survivor's compressed change (none completes without all of them), so each keeps
        the residual that compression left; if none completed, one that was inside the sync puts back the
        residual it had before it (compressing updated it before the exchange failed) and sends again."""
        if self.overlap:
            return self._heal_streaming()
        m, syncing = self.model, self._syncing
        self._syncing = None
        rows = m.membership.gather_ints([self.step, self._syncs, -1 if syncing is None else syncing])
        top_sync = max(r[1] for r in rows)
        if any(r[1] != top_sync for r in rows):  # some completed the sync: the others take its result
            done = [i for i, r in enumerate(rows) if r[1] == top_sync]
            src = max(done, key=lambda i: (rows[i][0], -i))
            m.membership.share_state(src, receive=rows[m.rank][1] != top_sync)
            return
        if syncing is not None and self._residuals_before:
            for residual, before in zip(self.frags[syncing].residuals, self._residuals_before[syncing]):
                residual.copy_(before)
        self.step = max(r[0] for r in rows)
        frag = max(r[2] for r in rows)
        if frag >= 0 and self.step >= self.warmup_steps:
            m.run_collective(f"{self.name} sync", lambda: self._sync_now(frag))
            self._syncs += 1

    def _heal_streaming(self):
        """``overlap``: the syncs run on a background thread, each merged ``overlap`` steps after it started,
        so a survivor may have merged a fragment's sync (it completed there, with every survivor's change and
        the lost worker's in it) that another one saw fail. Per fragment, the survivors behind by that merge
        take the anchors and outer optimizer state from one that made it and merge them into their own
        weights (``x <- alpha x + (1 - alpha) theta``); every sync not merged anywhere is dropped on every
        survivor (its change stays in the weights and travels with that fragment's next sync: the round in
        progress is dropped, no local step is). Every survivor then takes the furthest survivor's step count
        (one behind skips its missing local steps), so their syncs pair up again on a new background group
        (:meth:`regroup`)."""
        m, F = self.model, len(self.frags)
        rows = m.membership.gather_ints([self.step] + self._merges)
        for f in range(F):
            counts = [r[1 + f] for r in rows]
            top = max(counts)
            if min(counts) == top:
                continue
            src = counts.index(top)
            frag = self.frags[f]
            state = {"anchors": frag.anchors, "outer": self.outers[f].state_dict() if self.outers else None} \
                if m.rank == src else None
            state = broadcast_state(state, m.process_group, src)
            if counts[m.rank] < top:
                for anchor, a in zip(frag.anchors, state["anchors"]):
                    anchor.copy_(a)
                if self.outers:
                    self.outers[f].load_state_dict(state["outer"])
                frag.load_anchor(self.alpha)
                self._merges[f] = top
        self.pending = {}
        self.step = max(r[0] for r in rows)

    def regroup(self):
        """A new background thread and group over the new members (``overlap``; the old thread may sit in a
        collective with the lost peer: abandoned). After a loss the syncs in flight were dropped by
        :meth:`heal`; when joiners are admitted they were finished first (:meth:`after_step`) and are kept."""
        if self.background is not None:
            self.background.worker.abandon()
            self.background = Background(self.model, self.name)  # collective, as a joiner's init makes it

    def shared_state_dict(self):
        """A joiner's (or a healed survivor's) state: the whole of it, the same on every rank after a sync,
        but for the error-feedback residuals, which are each rank's own (a joiner's start at zero)."""
        state = self.state_dict()
        for frag in state["fragments"]:
            if frag["averager"]:
                frag["averager"] = {**frag["averager"], "residuals": []}  # loading it leaves them as they are
        return {"step": self.step, "syncs": self._syncs, "merges": list(self._merges), "state": state}

    def load_shared_state_dict(self, state):
        self.load_state_dict(state["state"])
        self._syncs = int(state["syncs"])
        self._merges = [int(n) for n in state["merges"]]
