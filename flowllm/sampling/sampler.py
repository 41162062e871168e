"""Batched sampling: one call turns a step's logits into one token per sequence.

The `sample` stage is a thin actor around `Sampler`. The sampler keeps what it needs about
each sequence (parameters, generator, token history) keyed by seq_id, learned from
`SeqStart` and dropped on release, so step messages carry only ids and logits.

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

Every step is skipped when no row of the batch uses it, so an all-greedy or all-plain batch
costs little more than one pass (argmax) or a softmax plus one summing pass. The logits
given are only read: steps 2-4 and the temperature work on copies in scratch buffers reused
across steps, so the model's output reaches the sampler without a copy of its own.

Randomness: unseeded rows draw their uniforms from one generator seeded at construction.
A seeded sequence owns a generator seeded from `sibling_seed(seed, index)` and draws exactly
one uniform per random step from it; every batched operation on its row is row-wise (with
reductions summed in fixed 256-token blocks) or exactly rounded, so the same seed and
logits give the same tokens whatever else is in the batch and wherever the row sits in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flowllm.kernels.argmax import argmax_rows
from flowllm.messages import SampledToken, SamplingParams, SeqStart, TokenLogprobs
from flowllm.sampling.grammar import apply_bitmask
from flowllm.sampling.stopping import StopChecker

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values are clamped to [-LIMIT, LIMIT]
_CDF_BLOCK = 256  # inverse CDF: block size of the two-level search
_RADIX_CHUNK = 1 << 21  # top_p: values per thresholding chunk (keeps temporaries small)
_SORT_VOCAB = 4096  # top_p: up to this vocabulary size a full sort is the cheaper way


class SamplerError(RuntimeError):
    """The sampler was driven inconsistently (unknown or duplicate seq_id, bad shapes)."""


def sibling_seed(seed: int, index: int) -> int:
    """The generator seed of choice `index` of a request seeded with `seed`.

    `seed + index` (mod 2**64), as vLLM seeds the children of an `n > 1` request: choice 0
    samples exactly like an `n = 1` request with the same seed, siblings differ from each
    other, and every choice is reproducible on its own.
    """
    return (seed + index) % 2**64


class _TokenHistory:
    """Distinct tokens of the prompt and outputs, with each one's count among the outputs.

    Penalties touch only these tokens, so they cost O(distinct tokens) per step instead of
    O(vocab). Arrays grow by doubling; `pos` maps a token id to its slot.
    """

    __slots__ = ("counts", "ids", "n", "pos")

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        distinct = list(dict.fromkeys(prompt_token_ids))
        capacity = max(16, 2 * len(distinct))
        self.ids = np.zeros(capacity, dtype=np.int64)  # [capacity], valid in [:n]
        self.counts = np.zeros(capacity, dtype=np.float32)  # output count of ids[i]
        self.ids[: len(distinct)] = distinct
        self.pos: dict[int, int] = {t: i for i, t in enumerate(distinct)}
        self.n = len(distinct)

    def add(self, token_id: int) -> None:
        i = self.pos.get(token_id)
        if i is None:
            if self.n == len(self.ids):
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            i = self.n
            self.ids[i] = token_id
            self.pos[token_id] = i
            self.n += 1
        self.counts[i] += 1.0


@dataclass(slots=True)
class _SeqState:
    """What the sampler keeps about one sequence."""

    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    stop: StopChecker  # the finish reason of each sampled token
    min_tokens_ids: torch.Tensor  # [k] int64: EOS ∪ stop_token_ids, masked before min_tokens
    greedy: bool
    generator: torch.Generator | None  # only for seeded, non-greedy sequences
    bias_ids: torch.Tensor | None  # [k] int64
    bias_values: torch.Tensor | None  # [k] float32, clamped
    history: _TokenHistory | None  # only when a penalty is active


class Sampler:
    """Per-sequence sampling state plus the batched sampling step.

    `seed` seeds the generator shared by unseeded rows (ModelConfig.seed);
    `max_model_len` feeds the "length" stop rule (None: no context limit);
    `device` is where logits arrive and where per-sequence generators live.
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
        self._seqs: dict[int, _SeqState] = {}
        self._buffers: dict[str, torch.Tensor] = {}  # reused batch-sized scratch, by role
        # How many known sequences ask for logprobs / may need a logits processor / sample
        # at random: at zero, `sample` skips the per-row scans for that feature.
        self._num_logprobs = self._num_processed = self._num_random = 0

    # ------------------------------------------------------------------ sequence state

    def start(self, seq: SeqStart) -> None:
        """Learn a sequence the first step it runs."""
        if seq.seq_id in self._seqs:
            raise SamplerError(f"seq_id {seq.seq_id} started twice")
        p = seq.params
        greedy = p.temperature < GREEDY_TEMPERATURE
        generator = None
        if p.seed is not None and not greedy:
            generator = torch.Generator(device=self._device)
            generator.manual_seed(sibling_seed(p.seed, seq.index))
        bias_ids = bias_values = None
        if p.logit_bias:
            bias_ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.int64)
            bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32).clamp_(
                -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT
            )
        penalized = (
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        )
        stop_ids = sorted(set(seq.eos_token_ids) | set(p.stop_token_ids))
        state = self._seqs[seq.seq_id] = _SeqState(
            params=p,
            prompt_token_ids=seq.prompt_token_ids,
            stop=StopChecker(p, seq.eos_token_ids, len(seq.prompt_token_ids), self._max_model_len),
            min_tokens_ids=torch.tensor(stop_ids, dtype=torch.int64),
            greedy=greedy,
            generator=generator,
            bias_ids=bias_ids,
            bias_values=bias_values,
            history=_TokenHistory(seq.prompt_token_ids) if penalized else None,
        )
        self._count(state, 1)

    def release(self, seq_id: int) -> None:
        """Forget a sequence (finished, aborted); unknown ids are ignored."""
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self._count(state, -1)

    def _count(self, state: _SeqState, sign: int) -> None:
        self._num_logprobs += sign * (state.params.logprobs is not None)
        self._num_random += sign * (not state.greedy)
        self._num_processed += sign * (
            state.bias_ids is not None
            or state.history is not None
            or (state.params.min_tokens > 0 and state.min_tokens_ids.numel() > 0)
        )

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
    ) -> list[SampledToken]:
        """Sample one token per row, record it, and say whether it ends its sequence.

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
        if self._num_processed and self._needs_processing(states, num_output_tokens):
            if not editable:
                work = self._buffer("logits", batch, vocab)  # [B, V]
                work.copy_(logits)
                logits, editable = work, True
            self._process(logits, states, num_output_tokens)

        # 5. choose
        tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
        if self._num_random:
            greedy_rows = [i for i, s in enumerate(states) if s.greedy]
            random_rows = [i for i, s in enumerate(states) if not s.greedy]
        else:
            greedy_rows, random_rows = list(range(batch)), []
        if len(greedy_rows) == batch:
            tokens = argmax_rows(logits)
        elif greedy_rows:
            g = torch.tensor(greedy_rows, device=logits.device)
            tokens[g] = argmax_rows(logits.index_select(0, g))
        if random_rows:
            chosen = self._sample_random(
                logits, random_rows, [states[i] for i in random_rows], editable
            )
            if len(random_rows) == batch:
                tokens = chosen
            else:
                tokens[torch.tensor(random_rows, device=logits.device)] = chosen
        token_list: list[int] = tokens.tolist()

        logprobs: list[TokenLogprobs | None] = [None] * batch
        if raw_logprobs is not None:
            chosen_lp = _token_logprobs(
                raw_logprobs,
                [token_list[i] for i in lp_rows],
                [states[i].params.logprobs or 0 for i in lp_rows],
                self._buffer("probs", len(lp_rows), vocab),
            )
            for row, entry in zip(lp_rows, chosen_lp, strict=True):
                logprobs[row] = entry

        out: list[SampledToken] = []
        append = out.append
        for sid, state, token, n, lp in zip(
            seq_ids, states, token_list, num_output_tokens, logprobs, strict=True
        ):
            if state.history is not None:
                state.history.add(token)
            finish, stop = state.stop(token, n + 1)
            if finish is None and lp is None:  # the common case: fewer fields to set
                append(SampledToken(seq_id=sid, token_id=token))
            else:
                append(
                    SampledToken(
                        seq_id=sid,
                        token_id=token,
                        logprobs=lp,
                        finish_reason=finish,
                        stop_reason=stop,
                    )
                )
        return out

    def prompt_logprobs(
        self, seq_id: int, num_computed_tokens: int, logits: torch.Tensor
    ) -> tuple[TokenLogprobs | None, ...]:
        """Logprobs of the prompt tokens that a prefill chunk's logits predict.

        logits: [T, V], row t computed at position num_computed_tokens + t, so it predicts
        prompt token num_computed_tokens + t + 1; rows past the prompt are ignored. The
        chunk at position 0 starts with None (nothing predicts the first token), so the
        chunks of one prompt concatenate to exactly one entry per prompt token. Returns ()
        when the sequence did not ask for prompt_logprobs.
        """
        state = self._state(seq_id)
        top_n = state.params.prompt_logprobs
        if top_n is None:
            return ()
        if logits.dim() != 2:
            raise SamplerError(f"prompt logits must be [T, V], got {tuple(logits.shape)}")
        prompt = state.prompt_token_ids
        first: tuple[TokenLogprobs | None, ...] = (None,) if num_computed_tokens == 0 else ()
        n = max(0, min(logits.shape[0], len(prompt) - 1 - num_computed_tokens))
        if n == 0:
            return first
        lp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, V]
        targets = list(prompt[num_computed_tokens + 1 : num_computed_tokens + 1 + n])
        return first + tuple(_token_logprobs(lp, targets, [top_n] * n, torch.empty_like(lp)))

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
        self._process(logits, self._states(seq_ids), num_output_tokens)

    # ------------------------------------------------------------------ internals

    def _states(self, seq_ids: Sequence[int]) -> list[_SeqState]:
        try:
            return list(map(self._seqs.__getitem__, seq_ids))
        except KeyError as e:
            raise SamplerError(
                f"unknown seq_id {e.args[0]}: not started or already released"
            ) from None

    def _state(self, seq_id: int) -> _SeqState:
        state = self._seqs.get(seq_id)
        if state is None:
            raise SamplerError(f"unknown seq_id {seq_id}: not started or already released")
        return state

    @staticmethod
    def _needs_processing(states: list[_SeqState], num_output_tokens: Sequence[int]) -> bool:
        """Does any row need min_tokens masking, a logit bias or a penalty this step?"""
        for i, s in enumerate(states):
            if (
                s.bias_ids is not None
                or (s.history is not None and s.history.n)
                or (num_output_tokens[i] < s.params.min_tokens and s.min_tokens_ids.numel())
            ):
                return True
        return False

    def _process(
        self, logits: torch.Tensor, states: list[_SeqState], num_output_tokens: Sequence[int]
    ) -> None:
        self._mask_min_tokens(logits, states, num_output_tokens)
        self._apply_logit_bias(logits, states)
        self._apply_penalties(logits, states)

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
        torch.index_select(logits, 0, torch.tensor(rows, device=logits.device), out=out)
        return out

    def _mask_min_tokens(
        self, logits: torch.Tensor, states: list[_SeqState], num_output_tokens: Sequence[int]
    ) -> None:
        """-inf on EOS and stop_token_ids for rows with fewer than min_tokens outputs."""
        rows: list[int] = []
        cols: list[torch.Tensor] = []
        for i, s in enumerate(states):
            if num_output_tokens[i] < s.params.min_tokens and s.min_tokens_ids.numel():
                rows.append(i)
                cols.append(s.min_tokens_ids)
        if not rows:
            return
        r, c = _flatten_rows(rows, cols, logits.shape[1], logits.device)
        logits[r, c] = float("-inf")

    def _apply_logit_bias(self, logits: torch.Tensor, states: list[_SeqState]) -> None:
        rows: list[int] = []
        cols: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        for i, s in enumerate(states):
            if s.bias_ids is not None and s.bias_values is not None:
                rows.append(i)
                cols.append(s.bias_ids)
                vals.append(s.bias_values)
        if not rows:
            return
        vocab = logits.shape[1]
        c_all = torch.cat(cols)
        v_all = torch.cat(vals).to(logits.device)
        counts = torch.tensor([len(c) for c in cols])
        r_all = torch.repeat_interleave(torch.tensor(rows), counts)
        keep = (c_all >= 0) & (c_all < vocab)  # out-of-vocab ids are the validator's to reject
        r_all, c_all, v_all = r_all[keep], c_all[keep], v_all[keep.to(v_all.device)]
        r_all, c_all = r_all.to(logits.device), c_all.to(logits.device)
        logits.index_put_((r_all, c_all), v_all, accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, states: list[_SeqState]) -> None:
        """Repetition, frequency and presence penalties on each row's distinct tokens."""
        rows = [i for i, s in enumerate(states) if s.history is not None and s.history.n]
        if not rows:
            return
        hists = [states[i].history for i in rows]
        lens = torch.tensor([h.n for h in hists if h is not None])
        ids = np.concatenate([h.ids[: h.n] for h in hists if h is not None])
        counts = np.concatenate([h.counts[: h.n] for h in hists if h is not None])
        dev = logits.device
        r = torch.repeat_interleave(torch.tensor(rows), lens).to(dev)  # [N]
        c = torch.from_numpy(ids).to(dev)  # [N] distinct token ids per row
        cnt = torch.from_numpy(counts).to(dev)  # [N] output counts (0: prompt only)

        def per_token(values: list[float]) -> torch.Tensor:
            return torch.repeat_interleave(torch.tensor(values, dtype=torch.float32), lens).to(dev)

        rep = per_token([states[i].params.repetition_penalty for i in rows])
        freq = per_token([states[i].params.frequency_penalty for i in rows])
        pres = per_token([states[i].params.presence_penalty for i in rows])
        if int(c.max()) >= logits.shape[1] or int(c.min()) < 0:
            keep = (c >= 0) & (c < logits.shape[1])  # ids the model cannot emit: no logit
            r, c, cnt, rep, freq, pres = (t[keep] for t in (r, c, cnt, rep, freq, pres))
        vals = logits[r, c]  # [N]
        vals = torch.where(vals > 0, vals / rep, vals * rep)
        vals = vals - freq * cnt
        vals = vals - pres * (cnt > 0).float()
        logits[r, c] = vals

    def _sample_random(
        self, logits: torch.Tensor, rows: list[int], states: list[_SeqState], editable: bool
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
            t = torch.tensor(temps, dtype=torch.float32, device=dev).unsqueeze(1)  # [R, 1]
            if lg is logits and not editable:
                lg = torch.div(lg, t, out=self._buffer("gather", n, vocab))
            else:
                lg.div_(t)
        probs = self._buffer("probs", n, vocab)  # [R, V]; rows sum to 1 until masked below
        torch.softmax(lg, dim=-1, out=probs)

        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            top = probs.amax(dim=-1, keepdim=True)  # [R, 1]
            floor = torch.tensor(min_ps, dtype=torch.float32, device=dev).unsqueeze(1) * top
            _zero_below(probs, floor, self._buffer("mask", n, vocab))

        k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
        if k_rows:
            ks = [params[i].top_k for i in k_rows]
            _keep_top_k(probs, k_rows, ks, self._buffer("mask", len(k_rows), vocab))

        p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            ps = [params[i].top_p for i in p_rows]
            _keep_top_p(probs, p_rows, ps, self._buffer("mask", len(p_rows), vocab))

        u = torch.empty(n, dtype=torch.float32, device=dev)  # [R] uniforms in [0, 1)
        unseeded = [i for i, s in enumerate(states) if s.generator is None]
        if unseeded:
            draws = torch.rand(len(unseeded), generator=self._generator, device=dev)
            if len(unseeded) == n:
                u = draws
            else:
                u[torch.tensor(unseeded, device=dev)] = draws
        for i, s in enumerate(states):
            if s.generator is not None:
                u[i] = torch.rand(1, generator=s.generator, device=dev)[0]
        return _inverse_cdf(probs, u)


# ---------------------------------------------------------------------- batched helpers


def _flatten_rows(
    rows: list[int], cols: list[torch.Tensor], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column) pairs for per-row column lists, dropping out-of-vocab columns."""
    c = torch.cat(cols)
    r = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(x) for x in cols]))
    keep = (c >= 0) & (c < vocab)
    return r[keep].to(device), c[keep].to(device)


def _select_rows(probs: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the rows to filter, their index): probs itself (index None) when rows are all rows."""
    if len(rows) == probs.shape[0]:
        return probs, None
    idx = torch.tensor(rows, device=probs.device)
    return probs.index_select(0, idx), idx


def _zero_below(x: torch.Tensor, floor: torch.Tensor, scratch: torch.Tensor) -> None:
    """x[i, j] = 0 where x[i, j] < floor[i]; x >= 0 and finite, scratch shaped like x.

    A multiply by a 0/1 float mask: several times faster on CPU than masked_fill_.
    """
    torch.ge(x, floor, out=scratch)
    x.mul_(scratch)


def _keep_top_k(
    probs: torch.Tensor, rows: list[int], ks: list[int], scratch: torch.Tensor | None = None
) -> None:
    """Zero all but each row's k largest probabilities (ties with the k-th kept).

    scratch: [len(rows), V] float32 to overwrite (allocated when None).
    """
    sub, idx = _select_rows(probs, rows)  # [Rk, V]
    top = sub.topk(max(ks), dim=-1).values  # [Rk, kmax], descending
    kth = top.gather(1, torch.tensor(ks, device=probs.device).unsqueeze(1) - 1)  # [Rk, 1]
    _zero_below(sub, kth, torch.empty_like(sub) if scratch is None else scratch)
    if idx is not None:
        probs.index_copy_(0, idx, sub)


def _keep_top_p(
    probs: torch.Tensor, rows: list[int], ps: list[float], scratch: torch.Tensor | None = None
) -> None:
    """Keep each row's smallest top set with mass >= p × row mass (ties with its last kept).

    scratch: [len(rows), V] float32 to overwrite (allocated when None). The threshold (the
    value of the last token kept) comes from `_top_p_threshold`, without sorting the row.
    """
    dev = probs.device
    sub, idx = _select_rows(probs, rows)  # [Rp, V]
    target = _block_sums(sub).sum(dim=-1) * torch.tensor(ps, dtype=torch.float32, device=dev)
    if sub.shape[1] <= _SORT_VOCAB:
        threshold = _sorted_threshold(sub, target)  # [Rp]
    else:
        # chunks of ~2M values keep the int64 bucket ids under glibc's mmap threshold
        step = max(1, min(1024, _RADIX_CHUNK // sub.shape[1]))
        threshold = torch.cat(
            [
                _top_p_threshold(sub[i : i + step], target[i : i + step])
                for i in range(0, len(rows), step)
            ]
        )  # [Rp]
    _zero_below(sub, threshold.unsqueeze(1), torch.empty_like(sub) if scratch is None else scratch)
    if idx is not None:
        probs.index_copy_(0, idx, sub)


def _sorted_threshold(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`_top_p_threshold` by a full sort: cheaper than bucketing for small vocabularies."""
    values = probs.sort(dim=1, descending=True).values  # [P, V]
    m = torch.searchsorted(values.cumsum(dim=1), target.unsqueeze(1).contiguous())
    return values.gather(1, m.clamp_(max=probs.shape[1] - 1)).squeeze(1)


def _top_p_threshold(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The largest value t of each row such that the mass of the values >= t reaches target.

    probs: [P, V] >= 0; target: [P]. Equal to reading the threshold off a descending sort
    and its prefix sums (up to float rounding of the sums), without sorting the row:
    non-negative floats order like their int32 bit patterns, so the top 11 bits (exponent
    and 3 mantissa bits: buckets of 1/8 octave) bucket the values in one pass; the bucket
    where the running mass from the top reaches the target is the only one that needs
    sorting, and it is small.
    """
    rows = probs.shape[0]
    dev = probs.device
    nb = 2048  # bucket = bits >> 20 for any non-negative float32
    bucket = (probs.view(torch.int32) >> 20).long()  # [P, V]
    mass = torch.zeros(rows, nb, dtype=torch.float32, device=dev)
    mass.scatter_add_(1, bucket, probs)  # [P, nb]
    at_or_above = mass.flip(1).cumsum(1).flip(1)  # [P, nb] mass of buckets >= b
    b = torch.arange(nb, device=dev)
    ok = (mass > 0) & (at_or_above >= target.unsqueeze(1))
    last_ok = torch.where(ok, b, -1).amax(dim=1, keepdim=True)  # [P, 1]
    first_nonempty = torch.where(mass > 0, b, nb - 1).amin(dim=1, keepdim=True)
    chosen = torch.where(last_ok >= 0, last_ok, first_nonempty)  # [P, 1] crossing bucket
    above = torch.where(
        chosen + 1 < nb, at_or_above.gather(1, (chosen + 1).clamp(max=nb - 1)), 0.0
    )  # [P, 1] mass of the buckets above it
    # The crossing bucket's values, one padded row each, sorted descending.
    r, j = (bucket == chosen).nonzero(as_tuple=True)  # row-major: r ascending
    counts = torch.bincount(r, minlength=rows)  # [P] >= 1
    starts = counts.cumsum(0) - counts
    pos = torch.arange(r.numel(), device=dev) - starts[r]
    cand = torch.zeros(rows, int(counts.max()), dtype=torch.float32, device=dev)
    cand[r, pos] = probs[r, j]
    cand = cand.sort(dim=1, descending=True).values  # [P, K]
    cum = cand.cumsum(dim=1) + above  # [P, K] mass of everything >= cand[:, k]
    m = torch.searchsorted(cum, target.unsqueeze(1).contiguous())  # first k reaching target
    m = torch.minimum(m, (counts - 1).unsqueeze(1))
    return cand.gather(1, m).squeeze(1)


def _block_sums(x: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R, ceil(V / 256)]: sums of consecutive 256-token blocks.

    Each block is summed serially whatever R is; a plain row sum would be split across
    threads when R = 1 and rounded differently than inside a batch.
    """
    rows, vocab = x.shape
    nb = vocab // _CDF_BLOCK
    parts = []
    if nb:
        parts.append(x[:, : nb * _CDF_BLOCK].reshape(rows, nb, _CDF_BLOCK).sum(dim=-1))
    if vocab % _CDF_BLOCK:
        parts.append(x[:, nb * _CDF_BLOCK :].sum(dim=-1, keepdim=True))
    return torch.cat(parts, dim=1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability proportional to `probs` (rows need mass > 0).

    Two levels so the cost is one summing pass: block sums of 256 tokens locate the block
    holding u × mass, then a cumsum inside that block alone locates the token. A token of
    zero probability is never returned, whatever the rounding.
    probs: [R, V] >= 0; u: [R] in [0, 1). Returns [R] int64.
    """
    vocab = probs.shape[1]
    block_cdf = _block_sums(probs).cumsum(dim=-1)  # [R, NB]
    total = block_cdf[:, -1:].contiguous()  # [R, 1]
    x = u.unsqueeze(1) * total  # [R, 1]
    b = torch.minimum(
        torch.searchsorted(block_cdf, x, right=True),  # first block whose cdf exceeds x
        torch.searchsorted(block_cdf, total),  # last block with mass (rounding guard)
    )  # [R, 1]
    before = torch.where(
        b > 0, block_cdf.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(x)
    )  # [R, 1]
    residual = (x - before).clamp_(min=0.0)
    cols = b * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=probs.device)  # [R, BLOCK]
    inside = probs.gather(1, cols.clamp(max=vocab - 1))
    inside.masked_fill_(cols >= vocab, 0.0)
    inner_cdf = inside.cumsum(dim=-1)  # [R, BLOCK]
    j = torch.minimum(
        torch.searchsorted(inner_cdf, residual, right=True),
        torch.searchsorted(inner_cdf, inner_cdf[:, -1:].contiguous()),  # last token with mass
    )
    # the clamp only matters for rows without finite mass (NaN logits): stay a valid id
    return (b * _CDF_BLOCK + j).squeeze(1).clamp_(0, vocab - 1)


def _token_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], top_ns: list[int], scratch: torch.Tensor
) -> list[TokenLogprobs]:
    """TokenLogprobs for row i's token_ids[i] and its top_ns[i] alternatives.

    logprobs: [R, V] log_softmax; scratch: [R, V] float32 to overwrite.
    rank = 1 + the number of tokens strictly more likely.
    """
    dev = logprobs.device
    tok = torch.tensor(token_ids, dtype=torch.int64, device=dev).unsqueeze(1)  # [R, 1]
    chosen = logprobs.gather(1, tok)  # [R, 1]
    torch.gt(logprobs, chosen, out=scratch)  # 1.0 where strictly more likely
    ranks = (scratch.sum(dim=-1) + 1).long().tolist()
    chosen_list = chosen.squeeze(1).tolist()
    k = min(max(top_ns), logprobs.shape[1])
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    out = []
    for i, (t, lp, rank, n) in enumerate(zip(token_ids, chosen_list, ranks, top_ns, strict=True)):
        top = tuple(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n > 0 else ()
        out.append(TokenLogprobs(token_id=t, logprob=lp, rank=rank, top=top))
    return out
