"""`SpecDecoder`: the engine's step when a drafter is on (docs/architecture.md, decision 5).

Prompt chunks run as `mixed_step` calls without decode rows (mirrored into a model drafter's
pool); every decoding request is drafted for and verified with its drafts in one `verify_step`.
Drafting needs the newest tokens on the host, so a speculative step is synchronous: it collects
its own results (no lookahead).

Draft trees (`EngineConfig.spec_tree`, n-gram or eagle drafts): every row drafts up to the tree's T
nodes, verified at width T with the tree's mask (`steps.verify_step`); the accepted path's K/V
is moved into place right after (`spec_tree.commit_path`, module doc there), before anything
reads the slot's pages again. A row drafts only the nodes down to the depth its remaining
tokens allow (`DraftTree.nodes_within`) and whose slots fit its reserved pages.

Widths: a host drafter (n-gram) drafts 0..R tokens per row, and so does an EAGLE head whose
chains are cut by confidence (`EngineConfig.draft_confidence`), so a step verifies at the
smallest width (1, 2, 4, ... up to R) that covers its longest draft; a step in which a host
drafter drafted nothing is a plain decode (a model drafter verifies at least width 1: its pools
follow the target through verifications). With such drafts, the XLA attention path (CPU) and
more than one slot, the verification is ragged: the weight matmuls see one row per real token
(`steps.verify_rows`), because there they are compute-bound at batch 8 and padding rows cost
time. With the Pallas kernels (TPU/GPU) they are bound by reading the weights, padding rows are
nearly free and the padded layout needs fewer compiled variants; other model drafters draft R
for nearly every row.

Constraints (structured output): a constrained row's drafts are checked against its grammar
before verification (`_constrain`), and the target's distribution is masked at every verified
position, so acceptance is exact for the constrained distribution. Drafts after the first one
the grammar forbids are cut. That forbidden draft x itself is cut for a one-hot drafter (its
rejection would resample from norm(max(p - onehot(x), 0)) = p, since the mask makes p(x) = 0:
the same as sampling p at that position) but kept for a model drafter, whose residual
norm(max(p - q, 0)) differs from p: cutting it there and sampling p would bias the output (the
chi-square test in tests/test_speculative.py rejects that rule). The drafter itself drafts
unconstrained (its steps run on device with no host in the loop).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import jax
import numpy as np

from jaxinfer.config import CacheConfig, EngineConfig
from jaxinfer.engine import speculative, steps
from jaxinfer.engine.batching import BatchBuilder
from jaxinfer.engine.constraints import ConstraintCompiler, all_allowed
from jaxinfer.engine.eagle import EagleDrafter
from jaxinfer.engine.outputs import record_logprobs, record_prompt_logprobs
from jaxinfer.engine.request import Chunk, SchedulerOutput, TokenEvent
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.scheduler import Scheduler, reserve_lookahead
from jaxinfer.model import Llama
from jaxinfer.model.eagle import EagleHead, check_head_fits
from jaxinfer.model.kv_heads import fit_kv_heads


def make_drafter(config: EngineConfig, *, runner: ModelRunner, cache: CacheConfig, mesh=None,
                 draft_model: Llama | None = None,
                 draft_head: EagleHead | None = None) -> speculative.Drafter | None:
    """The drafter `config.speculative_method` names, for the target `runner` runs (None for
    "none"); a draft model or head given to another method is a ValueError."""
    method = config.speculative_method
    if draft_model is not None and method != "draft":
        raise ValueError(f"a draft model was given but speculative_method={method!r}; "
                         "use speculative_method='draft'")
    if draft_head is not None and method != "eagle":
        raise ValueError(f"a draft head was given but speculative_method={method!r}; "
                         "use speculative_method='eagle'")
    if method == "none":
        return None
    if method == "eagle":
        if draft_head is None:
            raise ValueError("speculative_method='eagle' needs a draft head "
                             "(--draft_head_path)")
        check_head_fits(draft_head.config, runner.config)
        return EagleDrafter(draft_head, runner.graph, runner.params, cache=cache,
                            max_slots=config.max_slots, mesh=mesh,
                            attention_impl=runner.attention_impl,
                            confidence=config.draft_confidence)
    if method == "ngram":
        return speculative.NGramDrafter(config.ngram_max, config.ngram_min)
    args = (cache, config.max_slots, mesh, runner.attention_impl)
    if method == "draft":
        if draft_model is None:
            raise ValueError("speculative_method='draft' needs a draft model "
                             "(--draft_model_path)")
        return speculative.ModelDrafter.from_model(fit_kv_heads(draft_model, mesh),
                                                   runner.config, *args)
    layers = config.self_spec_layers or max(1, runner.config.num_layers // 4)
    return speculative.ModelDrafter.self_speculative(runner.params, runner.config, layers, *args)


@dataclasses.dataclass
class SpecCounters:
    """rows: verification rows (one per decoding request per step); drafted / accepted: draft
    tokens proposed and verified / accepted; verify_calls: `verify_step` calls (a step without
    drafts decodes plainly); ragged_rows: flat rows ragged verifications needed (unbucketed)."""

    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_calls: int = 0
    ragged_rows: int = 0

    def stats(self) -> dict:
        return {"spec_verify_rows": self.rows, "spec_verify_calls": self.verify_calls,
                "spec_drafted_tokens": self.drafted, "spec_ragged_rows": self.ragged_rows,
                "spec_accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / max(self.drafted, 1),
                # tokens a verification row emits: accepted drafts + the correction/bonus
                "mean_accepted_length": (self.accepted + self.rows) / max(self.rows, 1)}


class SpecDecoder:
    """Drafts, verifies and records one speculative step (module doc)."""

    def __init__(self, drafter: speculative.Drafter, *, config: EngineConfig,
                 runner: ModelRunner, scheduler: Scheduler, builder: BatchBuilder,
                 constraints: ConstraintCompiler | None = None):
        self.drafter = drafter
        runner.feature_layers = drafter.feature_layers  # the target's layers it reads
        self.constraints = constraints
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self.builder = dataclasses.replace(builder, host_decode_rows=False)
        self.ragged = (drafter.variable_width and runner.attention_impl == "xla"
                       and config.max_slots > 1)
        self.counters = SpecCounters()
        self.tree = config.draft_tree

    def widths(self) -> list[int]:
        """Verification widths (drafts per row) a step may use: for a host drafter, powers of two
        below R, and R (a step verifies at the smallest covering its longest draft); for a
        model drafter, R; a draft tree's, its T nodes."""
        r = self.config.num_speculative_tokens
        if self.tree is not None:
            return [self.tree.num_nodes]
        if not self.drafter.variable_width:
            return [r]
        return speculative.chain_widths(r)

    def step(self, schedule: SchedulerOutput) -> tuple[list[TokenEvent], int]:
        """Runs the step's prompt chunks and its verification, then records every token.
        Returns (the token events, device step calls made)."""
        self.runner.copy_pages(schedule.copies, schedule.local_copies)
        self.drafter.copy_pages(schedule.copies, schedule.local_copies)
        rows = [self._draft_row(c) for c in schedule.decodes]
        table = self.builder.page_table(self.scheduler.running)
        prefills = dataclasses.replace(schedule, chunks=schedule.prefills)
        batches, samples = self.builder.build(prefills, self.scheduler.running)
        allowed = (self.constraints.masks([s.request for s in samples], self.config.max_slots)
                   if self.constraints is not None else None)
        outputs, prompts = [], []
        for batch, pages, scored in batches:
            if batch.chunk_tokens.shape[0]:
                out, prompt = self.runner.mixed(batch, pages, allowed, scored is not None)
                outputs.append(out)
                if scored is not None:
                    prompts.append((scored, prompt))
                self.drafter.mirror(batch, pages, self.runner.features)
        decoded = self._verify(rows, table, schedule.decodes) if rows else None
        calls = len(outputs) + (decoded is not None)
        host_outputs, host_decoded, host_prompts = jax.device_get(
            (outputs, decoded, [p for _, p in prompts]))
        now = time.perf_counter()
        for (chunk, _), prompt in zip(prompts, host_prompts):
            record_prompt_logprobs(chunk.request, prompt, chunk.start, chunk.num_tokens)
        items = []
        for s in samples:
            record_logprobs(s.request, host_outputs[s.call], s.row)
            items.append((s.request, int(host_outputs[s.call].tokens[s.row])))
        if host_decoded is not None:
            items += self._accepted(schedule.decodes, *host_decoded)
        return self.scheduler.update(items, now), calls

    def _draft_row(self, chunk: Chunk) -> speculative.DraftRow:
        """A decoding request's draft request, its lookahead pages reserved (no preemption)."""
        req = chunk.request
        room = req.max_new_tokens - len(req.output_ids) - 1
        if self.tree is None:
            want = min(self.config.num_speculative_tokens, room)
        else:  # the nodes no deeper than the accepted drafts the request may still emit
            want = self.tree.nodes_within(room)
        extra = reserve_lookahead(self.scheduler, req, want) if room > 0 else 0
        return speculative.DraftRow(chunk.slot, req.known_tokens(), chunk.start, extra)

    def _verify(self, rows: list[speculative.DraftRow], table: np.ndarray, decodes: list[Chunk]):
        """Drafts and verifies every decoding row (device arrays): ("verify", VerifyOutput,
        num_draft), or ("plain", SampleOutput, None) when nothing was drafted."""
        b, r = self.config.max_slots, self.config.spec_width
        pages = self.builder.pages(max(row.pos + row.max_draft + 1 for row in rows))
        if self.tree is None:
            ids, probs, num = self.drafter.propose(rows, r, b, table, pages)
        else:
            ids, probs, num = self.drafter.propose_tree(rows, self.tree, b, table, pages)
        num, allowed = self._constrain(decodes, ids, num)
        active = np.zeros((b,), bool)
        pos = np.zeros((b,), np.int32)
        for row in rows:
            active[row.slot], pos[row.slot] = True, row.pos
        width = r
        if self.drafter.variable_width:  # verify only as wide as the longest draft
            # (a model drafter's pools follow the target through verifications: never plain)
            longest = max(int(num.max()), 0 if self.drafter.one_hot else 1)
            width = next(w for w in self.widths() if w >= longest) if longest else 0
        if width == 0:  # nothing drafted: a plain decode step (one row per request)
            batch = dataclasses.replace(steps.MixedBatch.idle(b, self.builder.table_width),
                                        page_table=table, decode=active, decode_pos=pos,
                                        lora=self.builder.lora(self.scheduler.running))
            plain = None if allowed is None else np.ascontiguousarray(allowed[:, 0])
            out, _ = self.runner.mixed(batch, self.builder.pages(int(pos.max()) + 1),
                                       plain)
            return "plain", out, None
        self.counters.verify_calls += 1
        need = sum(int(num[row.slot]) + 1 for row in rows)
        if self.ragged:
            self.counters.ragged_rows += need
        vb = steps.VerifyBatch(page_table=table, active=active, pos=pos,
                               draft_ids=np.asarray(ids)[:, :width] if width < ids.shape[1]
                               else ids, num_draft=num,
                               lora=self.builder.lora(self.scheduler.running))
        num_rows = steps.verify_rows(need, b, width, ragged=self.ragged)
        if allowed is not None:
            allowed = np.ascontiguousarray(allowed[:, :width + 1])
        out = self.runner.verify(vb, probs, pages, num_rows, allowed, self.tree)
        self.drafter.absorb(vb, self.runner.features, pages,
                            None if self.tree is None else (out.path, out.num_emitted))
        return "verify", out, num

    def _constrain(self, decodes: list[Chunk], ids, num: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray | None]:
        """Constrained rows' drafts checked against their grammars (module doc): num_draft cut
        after the first forbidden draft (before it, for a one-hot drafter), and the masks
        i32[B, R + 1, W] of every position up to the last allowed draft (None: no row is
        constrained)."""
        constrained = [c for c in decodes if c.request.constraint is not None]
        if not constrained:
            return num, None
        host_ids, num = np.asarray(ids), np.array(num)
        allowed = all_allowed((self.config.max_slots, self.config.spec_width + 1),
                              self.runner.config.vocab_size)
        for c in constrained:
            if self.tree is not None:
                num[c.slot] = self._constrain_tree(c.request.constraint, host_ids[c.slot],
                                                   int(num[c.slot]), allowed[c.slot])
                continue
            drafts = host_ids[c.slot, :num[c.slot]]
            k = c.request.constraint.check_drafts(drafts, allowed[c.slot])
            if k < len(drafts):
                num[c.slot] = k + (not self.drafter.one_hot)
        return num, allowed

    def _constrain_tree(self, constraint, node_ids: np.ndarray, num: int,
                        allowed: np.ndarray) -> int:
        """A draft tree's constrained row: allowed[n] (i32[T + 1, W]) the mask after the root
        and node n's path. A node whose path the grammar forbids: for one-hot drafts that
        node and every later one are cut; a drafter with q keeps it (its rejection leaves the
        residual norm(max(p - q, 0)) its siblings and the correction are tested against, as a
        chain keeps its first forbidden draft), its row all ones (it is never accepted: its
        target probability, or an ancestor's, is 0). Returns the row's new num_draft."""
        depth = self.tree.max_depth
        masks = np.empty((depth + 1,) + allowed.shape[1:], allowed.dtype)
        constraint.check_drafts([], masks)
        allowed[0] = masks[0]
        for node in range(1, num + 1):
            path = [int(node_ids[a - 1]) for a in self.tree.ancestors(node)[1:]]
            if constraint.check_drafts(path, masks) < len(path):
                if self.drafter.one_hot:
                    return node - 1
                continue  # allowed[node] stays all ones
            allowed[node] = masks[len(path)]
        return num

    def _accepted(self, decodes: list[Chunk], kind: str, out, num) -> list:
        """(request, token or tokens) of each decoding request, counters and logprobs kept."""
        items = []
        for c in decodes:
            req, slot = c.request, c.slot
            self.counters.rows += 1
            if kind == "plain":
                record_logprobs(req, out, slot)
                items.append((req, int(out.tokens[slot])))
                continue
            n = int(out.num_emitted[slot])
            drafted = int(num[slot])
            self.counters.drafted += drafted
            self.counters.accepted += n - 1
            req.spec_drafted += drafted
            req.spec_accepted += n - 1
            for j in range(n):
                record_logprobs(req, out, (slot, j))
            items.append((req, [int(t) for t in out.tokens[slot, :n]]))
        return items

    def verify_variants(self, page_buckets: list[int]) -> list[tuple]:
        """The arguments (VerifyBatch, draft_probs, page bucket, flat rows, allowed = None, the
        draft tree) of a dummy `ModelRunner.verify` (no active row) at every width, page bucket
        and (ragged) row count: the verify_step variants a warm-up compiles."""
        b = self.config.max_slots
        table = np.zeros((b, self.builder.table_width), np.int32)
        zeros = np.zeros((b,), np.int32)
        variants = []
        for width in self.widths():
            vb = steps.VerifyBatch(page_table=table, active=np.zeros((b,), bool), pos=zeros,
                                   draft_ids=np.zeros((b, width), np.int32), num_draft=zeros,
                                   lora=np.full((b,), -1, np.int32))
            rows = (self.config.num_speculative_tokens if self.tree is None
                    else len(self.tree.expanded))
            probs = None if self.drafter.one_hot else np.zeros(
                (b, rows, self.runner.config.vocab_size), np.float32)
            sizes = sorted({steps.verify_rows(k, b, width, ragged=self.ragged)
                            for k in range(1, b * (width + 1) + 1)})
            variants += [(vb, probs, pages, num_rows, None, self.tree)
                         for pages, num_rows in itertools.product(page_buckets, sizes)]
        return variants

    def warmup(self, page_buckets: list[int], prefill_variants) -> int:
        """Compiles verify_step at every width, page bucket and (ragged) row count, and the
        drafter's steps; returns how many verify variants."""
        variants = self.verify_variants(page_buckets)
        for args in variants:
            self.runner.verify(*args)
        self.drafter.warmup(self.config.num_speculative_tokens, self.config.max_slots,
                            self.builder.table_width, page_buckets, prefill_variants,
                            tree=self.tree)
        return len(variants)
