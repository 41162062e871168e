"""Batched sampling: one call turns a step's logits into one token per sequence.

The `sample` stage is a thin actor around `Sampler`. The sampler keeps what it needs about
each sequence (`SeqSamplingState`: parameters, stop rule, generator, token history) keyed
by seq_id, learned from `SeqStart` and dropped on release, so step messages carry only ids
and logits. The parts live beside it: the logits processors (`logits_processors`), the
truncations (`truncation`), the draw (`inverse_cdf`) and the logprobs (`logprobs`).

Per step, for a batch of rows (one per sequence), in this order (vLLM's):

0. grammar masks: rows under a constraint keep only the tokens their grammar allows;
1. raw logprobs: `log_softmax` of the logits as the model gave them (rows asking only);
2. min_tokens: EOS and stop_token_ids get -inf while fewer than min_tokens outputs exist;
3. logit_bias: added, each value clamped to ±100;
4. penalties: repetition over prompt + output tokens (divide positive logits by the
   penalty, multiply negative ones), then frequency (times the output count) and presence
   (once per distinct output token) subtracted, these two over output tokens only;
5. greedy rows (temperature < 1e-5) take the argmax; the others divide by temperature,
   softmax, drop tokens below min_p × the top probability, keep the top_k, keep the
   smallest set of top tokens whose mass reaches top_p (ties kept), and draw one token by
   inverse CDF with a uniform number per row.

Verifying drafts (speculative decoding, `verify`), a sequence's rows are sampled position
by position, each position by the steps above with the sequence's state as if its earlier
positions' tokens had been generated one by one (penalties, min_tokens, the stop rule,
logprobs), and its drafts are kept while each equals the token its position draws. That
is the rejection sampling of a point-mass proposal: a draft x is kept with probability
p(x), and when not, the token drawn follows p without x, renormalised. Coupled to the
sampler's own draw (one uniform of the sequence's stream per position, as without drafts),
it gives the very tokens sampling without drafts gives, seeded or greedy.

Every step is skipped when no row of the batch uses it, so an all-greedy or all-plain batch
costs little more than one pass (argmax) or a softmax plus one summing pass. The logits
given are only read: steps 2-4 and the temperature work on copies in scratch buffers reused
across steps, so the model's output reaches the sampler without a copy of its own.

Randomness: unseeded rows draw their uniforms from one generator seeded at construction.
A seeded sequence owns a generator seeded from `sibling_seed(seed, index)` and uses the next
uniform of its stream at each random step (`SeededUniforms`: drawn ahead in blocks, read in
one gather); every batched operation on its row is row-wise (with reductions summed in fixed
256-token blocks) or exactly rounded, so the same seed and logits give the same tokens
whatever else is in the batch and wherever the row sits in it.

Per step the sampler runs a fixed number of batched tensor operations, whatever the number
of rows, and waits for the device once: the one copy of the chosen tokens to the host, with
the requested logprobs in the same copy. Per-row work is host-side Python only (the lists
of rows per feature, the stop rule); the result is columns (`SampledTokens`). That wait is
a step of its own (`choose`, then `finish`): every read of the logits comes before it, so
the chosen ids can feed the next step's inputs on the device while the host waits (async
scheduling).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, count
from typing import NamedTuple

import torch

from flowllm.kernels.argmax import argmax_rows
from flowllm.messages import FinishReason, SampledToken, SampledTokens, SeqStart, TokenLogprobs
from flowllm.sampling.inverse_cdf import inverse_cdf
from flowllm.sampling.logits_processors import (
    apply_bitmask,
    apply_processors,
    needs_processing,
)
from flowllm.sampling.logprobs import logprob_columns, logprob_entries, prompt_logprobs
from flowllm.sampling.seeded_uniforms import SeededUniforms
from flowllm.sampling.sequence_state import SeqSamplingState
from flowllm.sampling.transfer import to_device
from flowllm.sampling.truncation import keep_top_k, keep_top_p, zero_below


class SamplerError(RuntimeError):
    """The sampler was driven inconsistently (unknown or duplicate seq_id, bad shapes)."""


class Chosen(NamedTuple):
    """A step's tokens as `Sampler.choose` left them: chosen on the device, not yet copied
    to the host (`Sampler.finish` does that)."""

    seq_ids: Sequence[int]
    states: list[SeqSamplingState]
    num_output_tokens: Sequence[int]
    ids: torch.Tensor  # [B] int64 on the device, one per row
    lp_rows: list[int]  # the rows whose logprobs were asked for
    raw_logprobs: torch.Tensor | None  # [len(lp_rows), V]: those rows' log_softmax


class Sampler:
    """Per-sequence sampling state plus the batched sampling step.

    `seed` seeds the generator shared by unseeded rows (ModelConfig.seed);
    `max_model_len` feeds the "length" stop rule (None: no context limit);
    `device` is where logits arrive and where the generators live.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        max_model_len: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self._device = torch.device(device)
        self._max_model_len = max_model_len
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(seed % 2**64)
        self._uniforms = SeededUniforms(self._device)  # the seeded sequences' generators
        self._seqs: dict[int, SeqSamplingState] = {}
        self._buffers: dict[str, torch.Tensor] = {}  # reused batch-sized scratch, by role
        # How many known sequences ask for logprobs / may need a logits processor / sample
        # at random: at zero, `sample` skips the per-row scans for that feature.
        self._num_logprobs = self._num_processed = self._num_random = 0

    # ------------------------------------------------------------------ sequence state

    def start(self, seq: SeqStart) -> None:
        """Learn a sequence the first step it runs."""
        if seq.seq_id in self._seqs:
            raise SamplerError(f"seq_id {seq.seq_id} started twice")
        state = self._seqs[seq.seq_id] = SeqSamplingState.of(
            seq, self._max_model_len, self._uniforms
        )
        self._count(state, 1)

    def release(self, seq_id: int) -> None:
        """Forget a sequence (finished, aborted); unknown ids are ignored."""
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self._count(state, -1)
            if state.uniform_slot is not None:
                self._uniforms.remove(state.uniform_slot)

    def _count(self, state: SeqSamplingState, sign: int) -> None:
        self._num_logprobs += sign * (state.params.logprobs is not None)
        self._num_random += sign * (not state.greedy)
        self._num_processed += sign * state.has_processor

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    # ------------------------------------------------------------------ sampling

    def sample(
        self,
        seq_ids: Sequence[int],
        logits: torch.Tensor,
        num_output_tokens: Sequence[int],
        allowed: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> SampledTokens:
        """Sample one token per row, record it, and say whether it ends its sequence:
        `choose`, then `finish`."""
        return self.finish(self.choose(seq_ids, logits, num_output_tokens, allowed))

    def choose(
        self,
        seq_ids: Sequence[int],
        logits: torch.Tensor,
        num_output_tokens: Sequence[int],
        allowed: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> Chosen:
        """Choose one token per row on the logits' device, without waiting for it: every
        read of `logits` happens here, so once this returns the model may write its next
        step's logits where these were (a captured step's output), and the chosen ids may
        feed that step's inputs before the host sees them (async scheduling). `finish`
        then copies them to the host.

        logits: [B, V] float32, row i for seq_ids[i]; read only (it may be the model's
        output itself, even an inference tensor): rows that need editing are edited in a
        scratch buffer reused across steps, so an all-greedy batch without logits processors
        costs one argmax and no copy. num_output_tokens[i]: outputs of seq_ids[i] before
        this token. allowed: (rows, bitmask), the grammar masks of constrained rows
        (flowllm.sampling.grammar): their other tokens get -inf before anything else, so
        logprobs are those of the masked distribution.
        """
        if logits.dim() != 2 or logits.shape[0] != len(seq_ids):
            raise SamplerError(
                f"logits must be [len(seq_ids)={len(seq_ids)}, V], got {tuple(logits.shape)}"
            )
        if len(num_output_tokens) != len(seq_ids):
            raise SamplerError("num_output_tokens must have one entry per seq_id")
        if logits.dtype != torch.float32:
            logits = logits.float()
        states = self._states(seq_ids)
        batch, vocab = logits.shape

        # 0. grammar masks, on a copy in a reused buffer
        editable = False
        if allowed is not None and len(allowed[0]):
            work = self._buffer("logits", batch, vocab)  # [B, V]
            work.copy_(logits)
            logits, editable = work, True
            apply_bitmask(logits, allowed[1], allowed[0])

        # 1. raw logprobs, before anything below touches the logits
        lp_rows = (
            [i for i, s in enumerate(states) if s.params.logprobs is not None]
            if self._num_logprobs
            else []
        )
        raw_logprobs = None
        if lp_rows:
            rows = self._rows(logits, lp_rows, "gather")
            raw_logprobs = self._buffer("logprobs", len(lp_rows), vocab)  # [len(lp_rows), V]
            torch.log_softmax(rows, dim=-1, out=raw_logprobs)

        # 2-4. logits processors, on a copy in a reused buffer
        if self._num_processed and needs_processing(states, num_output_tokens):
            if not editable:
                work = self._buffer("logits", batch, vocab)  # [B, V]
                work.copy_(logits)
                logits, editable = work, True
            apply_processors(logits, states, num_output_tokens)

        # 5. choose
        dev = logits.device
        if self._num_random:
            greedy_rows = [i for i, s in enumerate(states) if s.greedy]
            random_rows = [i for i, s in enumerate(states) if not s.greedy]
        else:
            greedy_rows, random_rows = list(range(batch)), []
        if len(greedy_rows) == batch:
            tokens = argmax_rows(logits)
        else:
            tokens = torch.empty(batch, dtype=torch.int64, device=dev)
            if greedy_rows:
                g = to_device(greedy_rows, torch.int64, dev)
                tokens[g] = argmax_rows(logits.index_select(0, g))
        if random_rows:
            chosen = self._sample_random(
                logits, random_rows, [states[i] for i in random_rows], editable
            )
            if len(random_rows) == batch:
                tokens = chosen
            else:
                tokens[to_device(random_rows, torch.int64, dev)] = chosen

        return Chosen(seq_ids, states, num_output_tokens, tokens, lp_rows, raw_logprobs)

    def finish(self, chosen: Chosen) -> SampledTokens:
        """The chosen tokens on the host (the step's one copy to the host: the tokens, and
        the logprobs asked for), each recorded and checked against its stop rule. A row of
        a sequence that an earlier token ended (scheduled before that token was known) is
        dropped: no token, nothing recorded."""
        seq_ids, states, num_output_tokens, tokens, lp_rows, raw_logprobs = chosen
        batch = len(seq_ids)
        logprobs: list[TokenLogprobs | None] = []
        if raw_logprobs is None:
            token_list: list[int] = tokens.tolist()
        else:
            dev, vocab = raw_logprobs.device, raw_logprobs.shape[1]
            top_ns = [states[i].params.logprobs or 0 for i in lp_rows]
            k = min(max(top_ns), vocab)
            lp_tokens = tokens
            if len(lp_rows) != batch:
                lp_tokens = tokens.index_select(0, to_device(lp_rows, torch.int64, dev))
            columns = logprob_columns(
                raw_logprobs, lp_tokens, k, self._buffer("probs", len(lp_rows), vocab)
            )  # [len(lp_rows), 2 + 2k]
            host = torch.cat([tokens.double(), columns.view(-1)]).tolist()
            token_list = [int(t) for t in host[:batch]]
            width = columns.shape[1]
            table = [host[batch + j * width : batch + (j + 1) * width] for j in range(len(lp_rows))]
            entries = logprob_entries([token_list[i] for i in lp_rows], table, top_ns, k)
            logprobs = [None] * batch
            for row, entry in zip(lp_rows, entries, strict=True):
                logprobs[row] = entry

        finishes: dict[int, tuple[FinishReason, int | None]] = {}
        dropped: list[int] = []
        for row, state, token, n in zip(count(), states, token_list, num_output_tokens):
            if state.finished:
                dropped.append(row)
                continue
            if state.history is not None:
                state.history.add(token)
            rule = state.stop
            # the common case, no rule can end it, is one set lookup (StopRule.last_output)
            if token in rule.stopping_ids or n >= rule.last_output:
                finish, stop = rule(token, n + 1)
                if finish is not None:
                    state.finished = True
                    finishes[row] = (finish, stop)
        sampled = SampledTokens(
            seq_ids=tuple(seq_ids),
            token_ids=tuple(token_list),
            finishes=finishes,
            logprobs=tuple(logprobs),
        )
        if dropped:
            gone = set(dropped)
            sampled = sampled.take([row for row in range(batch) if row not in gone])
        return sampled

    def verify(
        self,
        seq_ids: Sequence[int],
        drafts: Sequence[Sequence[int]],
        logits: torch.Tensor,
        num_output_tokens: Sequence[int],
        allowed: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> SampledTokens:
        """Verify each sequence's drafts (module docstring): its accepted drafts and one
        token more (the one drawn at the first rejection, or after the last draft), each
        recorded and stopped as `sample` does, in sequence order.

        logits: [sum(len(drafts[i]) + 1), V], sequence i's `len(drafts[i]) + 1` rows in
        order (row j predicts the token after draft j - 1). A stop ends a sequence's run.
        allowed: (logits rows, bitmask), the grammar masks of constrained rows: bitmask row
        k masks logits row `rows[k]` (a verifying sequence has one per position).
        """
        counts = [len(d) + 1 for d in drafts]
        if logits.dim() != 2 or logits.shape[0] != sum(counts):
            raise SamplerError(
                f"logits must be [{sum(counts)}, V] for these drafts, got {tuple(logits.shape)}"
            )
        firsts = list(accumulate(counts, initial=0))
        mask_of = {} if allowed is None else {row: k for k, row in enumerate(allowed[0])}
        runs: list[list[SampledToken]] = [[] for _ in seq_ids]
        active = list(range(len(seq_ids)))
        position = 0
        while active:
            rows = [firsts[i] + position for i in active]
            at = logits
            if len(rows) != logits.shape[0]:
                at = logits.index_select(0, to_device(rows, torch.int64, logits.device))
            masked = [j for j, row in enumerate(rows) if row in mask_of]
            here = None
            if masked and allowed is not None:
                picks = torch.tensor([mask_of[rows[j]] for j in masked], dtype=torch.int64)
                here = (masked, allowed[1].index_select(0, picks))
            tokens = self.sample(
                [seq_ids[i] for i in active],
                at,
                [num_output_tokens[i] + position for i in active],
                here,
            )
            got = {token.seq_id: token for token in tokens}  # a few rows: read one by one
            still = []
            for i in active:
                token = got.get(seq_ids[i])
                if token is None:
                    continue
                runs[i].append(token)
                if (
                    position < len(drafts[i])
                    and token.token_id == drafts[i][position]
                    and token.finish_reason is None
                ):
                    still.append(i)
            active = still
            position += 1
        return SampledTokens.of(token for run in runs for token in run)

    def prompt_logprobs(
        self, seq_id: int, num_computed_tokens: int, logits: torch.Tensor
    ) -> tuple[TokenLogprobs | None, ...]:
        """Logprobs of the prompt tokens that a prefill chunk's logits [T, V] predict
        (flowllm.sampling.logprobs.prompt_logprobs); () when the sequence did not ask for
        prompt_logprobs."""
        state = self._state(seq_id)
        top_n = state.params.prompt_logprobs
        if top_n is None:
            return ()
        if logits.dim() != 2:
            raise SamplerError(f"prompt logits must be [T, V], got {tuple(logits.shape)}")
        return prompt_logprobs(state.prompt_token_ids, top_n, num_computed_tokens, logits)

    def apply_processors(
        self, seq_ids: Sequence[int], logits: torch.Tensor, num_output_tokens: Sequence[int]
    ) -> None:
        """Apply min_tokens, logit_bias and the penalties to `logits` [B, V] in place.

        This is what `sample` does before choosing; exposed so that processed logits can be
        inspected (tests, debugging) without sampling or recording anything.
        """
        if logits.dim() != 2 or logits.shape[0] != len(seq_ids):
            raise SamplerError(
                f"logits must be [len(seq_ids)={len(seq_ids)}, V], got {tuple(logits.shape)}"
            )
        apply_processors(logits, self._states(seq_ids), num_output_tokens)

    # ------------------------------------------------------------------ internals

    def _states(self, seq_ids: Sequence[int]) -> list[SeqSamplingState]:
        try:
            return list(map(self._seqs.__getitem__, seq_ids))
        except KeyError as e:
            raise SamplerError(
                f"unknown seq_id {e.args[0]}: not started or already released"
            ) from None

    def _state(self, seq_id: int) -> SeqSamplingState:
        state = self._seqs.get(seq_id)
        if state is None:
            raise SamplerError(f"unknown seq_id {seq_id}: not started or already released")
        return state

    def _buffer(self, key: str, rows: int, vocab: int) -> torch.Tensor:
        """A reused [rows, vocab] float32 scratch tensor.

        Batch-sized temporaries are tens of MB; allocating them afresh each step costs page
        faults that can exceed the arithmetic, so each role keeps one buffer and grows it.
        """
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < rows * vocab:
            buf = torch.empty(rows * vocab, dtype=torch.float32, device=self._device)
            self._buffers[key] = buf
        return buf[: rows * vocab].view(rows, vocab)

    def _rows(self, logits: torch.Tensor, rows: list[int], key: str) -> torch.Tensor:
        """logits itself when `rows` is every row, else those rows copied into a buffer."""
        if len(rows) == logits.shape[0]:
            return logits
        out = self._buffer(key, len(rows), logits.shape[1])
        torch.index_select(logits, 0, to_device(rows, torch.int64, logits.device), out=out)
        return out

    def _sample_random(
        self, logits: torch.Tensor, rows: list[int], states: list[SeqSamplingState], editable: bool
    ) -> torch.Tensor:
        """Temperature, min_p, top_k, top_p and the draw for the non-greedy rows: [R] int64.

        `editable`: logits is the sampler's own scratch (else it is only read)."""
        vocab = logits.shape[1]
        dev = logits.device
        n = len(rows)
        lg = self._rows(logits, rows, "gather")  # [R, V]
        params = [s.params for s in states]

        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            t = to_device(temps, torch.float32, dev).unsqueeze(1)  # [R, 1]
            if lg is logits and not editable:
                lg = torch.div(lg, t, out=self._buffer("gather", n, vocab))
            else:
                lg.div_(t)
        probs = self._buffer("probs", n, vocab)  # [R, V]; rows sum to 1 until masked below
        torch.softmax(lg, dim=-1, out=probs)

        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            top = probs.amax(dim=-1, keepdim=True)  # [R, 1]
            floor = to_device(min_ps, torch.float32, dev).unsqueeze(1) * top
            zero_below(probs, floor, self._buffer("mask", n, vocab))

        k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
        if k_rows:
            ks = [params[i].top_k for i in k_rows]
            keep_top_k(probs, k_rows, ks, self._buffer("mask", len(k_rows), vocab))

        p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            ps = [params[i].top_p for i in p_rows]
            keep_top_p(probs, p_rows, ps, self._buffer("mask", len(p_rows), vocab))

        # [R] uniforms in [0, 1): seeded rows from their own streams, the others from the
        # sampler's generator
        slots = [s.uniform_slot for s in states]
        seeded_slots = [slot for slot in slots if slot is not None]
        if not seeded_slots:
            u = torch.rand(n, generator=self._generator, device=dev)
        elif len(seeded_slots) == n:
            u = self._uniforms.draw(seeded_slots)
        else:
            u = torch.empty(n, dtype=torch.float32, device=dev)
            unseeded = [i for i, slot in enumerate(slots) if slot is None]
            seeded = [i for i, slot in enumerate(slots) if slot is not None]
            u[to_device(unseeded, torch.int64, dev)] = torch.rand(
                len(unseeded), generator=self._generator, device=dev
            )
            u[to_device(seeded, torch.int64, dev)] = self._uniforms.draw(seeded_slots)
        return inverse_cdf(probs, u)
