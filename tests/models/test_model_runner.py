"""ModelRunner's flattened inputs: positions, slots, block tables and logit rows; the
kernels' threads per step."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from flowllm.engine.core import small_step_threads
from flowllm.messages import ScheduledSeq
from flowllm.models.gpt2 import GPT2Model
from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.runner import SMALL_STEP_ROWS, ModelRunner, StepInputError, StepInputs


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
    inp = StepInputs(seqs, block_size=16, prompt_logits_for={12, 13})
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
    assert inp.sample_at == [5, 6, 7]


def test_short_block_table_and_empty_chunk_raise() -> None:
    with pytest.raises(StepInputError, match=r"sequence 3 reaches 17 tokens.*2 blocks"):
        StepInputs([seq(3, (1,), 16, (0,))], 16, ())
    with pytest.raises(StepInputError, match="no tokens"):
        StepInputs([seq(4, (), 0, (0,))], 16, ())


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


def test_small_steps_run_the_kernels_on_small_step_threads() -> None:
    """A step of at most SMALL_STEP_ROWS rows runs the native kernels on
    `small_step_threads`; a larger one, every step without the setting, and every pooling
    step (an encoder's oneDNN sums depend on the thread count), on torch's."""
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    model = GPT2Model(cfg, torch.float32, "cpu")
    kv = KVCacheSpec.for_model(model, 4).allocate(8, "cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = ModelRunner(model, kv, 4, "cpu", small_step_threads=1)
        assert runner.kernel_threads(1) == runner.kernel_threads(SMALL_STEP_ROWS) == 1
        assert runner.kernel_threads(SMALL_STEP_ROWS + 1) == 2
        assert ModelRunner(model, kv, 4, "cpu").kernel_threads(1) == 2
        if runner.native is not None:  # the pool the kernels see follows each step
            runner.run([seq(1, (1, 2, 3), 0, (3,))])
            assert runner.native.omp_max_threads() == 1
            runner.run([seq(2, tuple(range(1, 10)), 0, (0, 1, 2))])
            assert runner.native.omp_max_threads() == 2
            runner.run([seq(3, (1, 2, 3), 0, (3,))])
            runner.hidden_states([seq(4, (1, 2, 3), 0, (4,))])  # a pooling step: all of them
            assert runner.native.omp_max_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("threads", "fronts", "cpus", "small"),
    [(2, 1, 2, 1), (16, 4, 16, 12), (4, 1, 8, None), (1, 1, 1, None), (2, 1, None, 1)],
)
def test_a_core_leaves_the_fronts_cores_to_them_on_small_steps(
    threads: int, fronts: int, cpus: int | None, small: int | None
) -> None:
    assert small_step_threads(threads, fronts, cpus) == small
