"""A tick's shape (engine.batch.shape): what the rank loop's step trace records and the
simulator times a tick by."""

from atoll.config.sampling import SamplingParams
from atoll.engine.batch.request import Request
from atoll.engine.batch.scheduler import Scheduled, Sequence
from atoll.engine.batch.shape import block_bucket, seq_buckets, step_shape


def _decoding(prompt: int, out: int) -> Scheduled:
    seq = Sequence(Request(0, [1] * prompt, SamplingParams(max_tokens=64)), None, output=[2] * out)
    return Scheduled(seq, prompt + out - 1, 1)


def test_block_bucket_is_a_power_of_two_of_at_least_two_capped():
    assert [block_bucket(b) for b in (1, 2, 3, 5, 9, 100)] == [2, 2, 4, 8, 16, 128]
    assert block_bucket(100, 64) == 64


def test_a_compiled_decode_step_reads_every_row_up_to_the_longest_padded():
    # contexts 33 and 280: the sum is 313 keys, the compiled step reads 2 rows x 32 blocks of 16
    rows = [_decoding(32, 2), _decoding(32, 249)]
    s = step_shape(rows, 16)
    assert (s.rows, s.chunk_tokens, s.ctx_sum) == (2, 0, 34 + 281)
    assert s.ctx_padded == 2 * 32 * 16
    assert step_shape(rows, 16, max_blocks=20).ctx_padded == 2 * 20 * 16  # capped at max_model_len's blocks
    assert step_shape(rows).ctx_padded == s.ctx_sum  # no block size: the keys are the contexts
    prompt = Scheduled(Sequence(Request(1, [1] * 40, SamplingParams()), None), 0, 40)
    s = step_shape([prompt], 16)
    assert (s.rows, s.chunk_tokens, s.ctx_padded) == (0, 40, 0.0)


def test_padding_rows_read_the_same_width():
    # 3 rows run in the 4-row bucket: 4 x 2 blocks of 16
    rows = [_decoding(8, 2), _decoding(8, 3), _decoding(8, 4)]
    assert step_shape(rows, 16, buckets=[1, 2, 4, 8]).ctx_padded == 4 * 2 * 16
    assert step_shape(rows, 16).ctx_padded == 3 * 2 * 16  # no buckets given: the rows themselves
    assert seq_buckets(20) == [1, 2, 4, 8, 16, 20]
