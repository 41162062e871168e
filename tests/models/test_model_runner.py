"""ModelRunner's flattened inputs: positions, slots, block tables and logit rows; a step's
results on any thread count."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from flowllm import openmp
from flowllm.messages import ScheduledRows, ScheduledSeq
from flowllm.models.gpt2 import GPT2Model
from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.runner import ModelRunner, StepInputError, StepInputs


def seq(
    seq_id: int, tokens: tuple[int, ...], computed: int, table: tuple[int, ...], sample: bool = True
) -> ScheduledSeq:
    return ScheduledSeq(
        seq_id=seq_id,
        token_ids=tokens,
        num_computed_tokens=computed,
        block_table=table,
        sample=sample,
        num_output_tokens=0,
    )


def test_step_inputs_layout() -> None:
    seqs = [
        seq(10, (5, 6, 7), 0, (4,)),  # prefill
        seq(11, (8,), 17, (2, 9)),  # decode at position 17 -> block 9, offset 1
        seq(12, (1, 2), 3, (7,), sample=False),  # a chunk that does not sample
        seq(13, (3, 4, 5), 14, (0, 6)),  # a chunk crossing from block 0 into block 6
    ]
    inp = StepInputs(ScheduledRows.of(seqs), block_size=16, prompt_logits_for={12, 13})
    assert inp.input_ids.tolist() == [5, 6, 7, 8, 1, 2, 3, 4, 5]
    assert inp.positions.tolist() == [0, 1, 2, 17, 3, 4, 14, 15, 16]
    assert inp.slot_mapping.tolist() == [64, 65, 66, 145, 115, 116, 14, 15, 96]
    assert inp.query_start_loc.tolist() == [0, 3, 4, 6, 9]
    assert inp.seq_lens.tolist() == [3, 18, 5, 17]
    assert inp.block_tables.tolist() == [[4, 0], [2, 9], [7, 0], [0, 6]]
    assert (inp.max_query_len, inp.max_seq_len) == (3, 18)
    # Prompt-logit rows first (seq 12 then 13), then the last row of each sampling seq.
    assert inp.logits_indices.tolist() == [4, 5, 6, 7, 8, 2, 3, 8]
    assert inp.prompt_rows == {12: (0, 2), 13: (2, 5)}
    assert list(inp.sample_at) == [5, 6, 7]


def test_short_block_table_and_empty_chunk_raise() -> None:
    with pytest.raises(StepInputError, match=r"sequence 3 reaches 17 tokens.*2 blocks"):
        StepInputs(ScheduledRows.of([seq(3, (1,), 16, (0,))]), 16, ())
    with pytest.raises(StepInputError, match="no tokens"):
        StepInputs(ScheduledRows.of([seq(4, (), 0, (0,))]), 16, ())


def test_run_returns_editable_float32_rows_in_batch_order() -> None:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    ref = GPT2LMHeadModel(cfg).eval()
    model = GPT2Model(cfg, torch.float32, "cpu")
    model.load_weights(ref.state_dict().items())
    runner = ModelRunner(model, KVCacheSpec.for_model(model, 4).allocate(8, "cpu"), 4, "cpu")
    assert runner.run([])[0].shape == (0, 64)
    logits, prompt = runner.run(
        [seq(1, (1, 2, 3, 4, 5), 0, (3, 1)), seq(2, (9, 8), 0, (0,), sample=False)], {1, 2}
    )
    with torch.no_grad():
        want1 = ref(torch.tensor([[1, 2, 3, 4, 5]])).logits[0]
        want2 = ref(torch.tensor([[9, 8]])).logits[0]
    assert logits.shape == (1, 64) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], want1[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prompt[1], want1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prompt[2], want2, atol=1e-5, rtol=1e-5)
    logits.div_(2.0)  # a sampler may edit the logits in place
    prompt[1].sub_(1.0)


def test_a_steps_logits_do_not_depend_on_the_thread_count_where_the_runner_says_so() -> None:
    """`exact_on_any_threads` (the native kernels split no sum between threads): a step's
    logits on one OpenMP thread equal its logits on two, so a short step may run on the
    loop's one thread instead of the model's thread."""
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64)
    model = GPT2Model(cfg, torch.float32, "cpu")
    model.load_weights(GPT2LMHeadModel(cfg).state_dict().items())
    kv = KVCacheSpec.for_model(model, 4).allocate(8, "cpu")
    runner = ModelRunner(model, kv, 4, "cpu", enforce_eager=True)
    if not runner.exact_on_any_threads:
        pytest.skip("torch's own CPU products may split sums by the thread count")
    seqs = [seq(1, tuple(range(1, 10)), 0, (0, 1, 2)), seq(2, (5, 6, 7, 8, 9), 0, (3, 4))]

    def logits_on(threads: int) -> torch.Tensor:
        openmp.size_pool(threads)
        return runner.run(seqs)[0]

    one, two = (openmp.in_passing_thread(logits_on, n) for n in (1, 2))
    assert torch.equal(one, two)
