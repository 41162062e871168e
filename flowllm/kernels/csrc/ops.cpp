/* The kernels as torch ops: `torch.ops.flowllm.<name>`, each with a typed schema, a CPU
 * implementation that checks its tensors (device, dtype, shape, layout) and runs the
 * kernel of the build in use, and a Meta implementation that makes the same checks and
 * runs nothing, so fake tensors and torch.compile see the ops as they are.
 *
 * The kernels live in one library per ISA build (plain C, kernel_args.h). This library is
 * built once per torch version, without ISA flags: `flowllm_ops_use(path)` loads a build's
 * library and binds its kernels, which the ops run from then on (flowllm/kernels/native.py
 * chooses the build). It is linked without libtorch: its torch symbols bind when it loads to
 * the libraries torch has loaded, which native.py makes global first.
 *
 * Kernels that check index values (lengths, block ids, slots, positions, row ids) before
 * writing return what they refused; the op raises it (ValueError, IndexError, or torch's
 * OutOfMemoryError for a kernel's scratch), so every op returns nothing and traces whole.
 *
 * Between record_start() and record_stop() a thread's kernel calls are also appended, as
 * they ran, to a call list ([kernel address, words, argument struct as int64 words...] per
 * call) that run_calls replays in one call (flowllm/kernels/call_plan.py). */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernel_args.h"

namespace {

using at::Tensor;
using std::optional;

/* ---- The build in use ---- */

struct Kernels {
#define FLOWLLM_KERNEL_FIELD(kernel, ...) decltype(&flowllm_##kernel) kernel = nullptr;
  FLOWLLM_KERNELS(FLOWLLM_KERNEL_FIELD)
#undef FLOWLLM_KERNEL_FIELD
  bool has_bf16 = false;
};

std::atomic<const Kernels *> active{nullptr};

const Kernels &kernels() {
  const Kernels *k = active.load();
  TORCH_CHECK(k != nullptr, "flowllm: no native kernel build is in use");
  return *k;
}

/* ---- Recording ---- */

thread_local std::vector<int64_t> *recording = nullptr;

template <typename Args>
int64_t run(int64_t (*fn)(const Args *), const Args &args) {
  static_assert(sizeof(Args) % sizeof(int64_t) == 0, "argument structs are int64 words");
  const int64_t status = fn(&args);
  if (recording != nullptr) {
    constexpr int64_t words = sizeof(Args) / sizeof(int64_t);
    int64_t copy[words];
    std::memcpy(copy, &args, sizeof(Args));
    recording->push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(fn)));
    recording->push_back(words);
    recording->insert(recording->end(), copy, copy + words);
  }
  return status;
}

/* ---- Checks ---- */

/* Every tensor of a call on one device: the CPU, or meta in the Meta implementations. */
void same_device(const Tensor &first, const Tensor &t, const char *name) {
  TORCH_CHECK(t.device() == first.device(), name, " is on ", t.device(), ", not ", first.device());
}

void dtype_is(const Tensor &t, at::ScalarType dtype, const char *name) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

void contiguous(const Tensor &t, const char *name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, got shape ", t.sizes(),
                    " strides ", t.strides());
}

void shape_is(const Tensor &t, at::IntArrayRef shape, const char *name) {
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must be of shape ", shape, ", got ", t.sizes());
}

/* A contiguous tensor of one dtype and shape, on `first`'s device. */
void exactly(const Tensor &first, const Tensor &t, at::ScalarType dtype, at::IntArrayRef shape,
             const char *name) {
  same_device(first, t, name);
  dtype_is(t, dtype, name);
  shape_is(t, shape, name);
  contiguous(t, name);
}

void activation(const Tensor &t, const char *name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                   " must be float32 or bfloat16, got ", t.scalar_type());
}

bool is_bf16(const Tensor &t) { return t.scalar_type() == at::kBFloat16; }

template <typename T = void>
T *ptr(const Tensor &t) {
  return static_cast<T *>(t.data_ptr());
}

template <typename T = void>
T *ptr(const optional<Tensor> &t) {
  return t.has_value() ? static_cast<T *>(t->data_ptr()) : nullptr;
}

/* ---- The ops: Run is false in the Meta implementations ---- */

template <bool Run>
void linear(const Tensor &x, const Tensor &w, const optional<Tensor> &bias, const Tensor &y) {
  activation(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2 && y.dim() == 2, "x and y must be 2-D, got ", x.sizes(), " and ",
                    y.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  const int64_t blocks = (n + 15) / 16;
  const bool bf16 = is_bf16(x);
  contiguous(x, "x");
  if (bf16) {
    exactly(x, w, at::kBFloat16, {blocks, (k + 1) / 2, 16, 2}, "w");
    TORCH_CHECK_TYPE(y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kFloat,
                     "y must be bfloat16 or float32, got ", y.scalar_type());
  } else {
    exactly(x, w, at::kFloat, {blocks, k, 16}, "w");
    dtype_is(y, at::kFloat, "y");
  }
  exactly(x, y, y.scalar_type(), {m, n}, "y");
  if (bias.has_value()) exactly(x, *bias, x.scalar_type(), {n}, "bias");
  if (!Run || m == 0) return;
  const Kernels &kn = kernels();
  if (bf16) {
    TORCH_CHECK(kn.has_bf16, "the bf16 linear product needs AVX512-BF16 and the AVX-512 build");
    run(kn.linear_bf16, {ptr<const bf16_t>(x), ptr<const bf16_t>(w), ptr<const bf16_t>(bias),
                         ptr(y), m, n, k, y.scalar_type() == at::kFloat});
  } else {
    run(kn.linear_f32,
        {ptr<const float>(x), ptr<const float>(w), ptr<const float>(bias), ptr<float>(y), m, n, k});
  }
}

/* query/out: [tokens, heads, head_dim], each token's heads contiguous, tokens not overlapping
 * (any token stride past that). */
void token_rows(const Tensor &first, const Tensor &t, int64_t head_dim, const char *name) {
  same_device(first, t, name);
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(2) == head_dim && t.stride(2) == 1 &&
                        t.stride(1) == head_dim &&
                        (t.size(0) <= 1 || t.stride(0) >= t.size(1) * head_dim),
                    name, " must be [tokens, heads, head_dim=", head_dim,
                    "] with each token's heads contiguous and tokens apart, got shape ", t.sizes(),
                    " strides ", t.strides());
}

void caches(const Tensor &k_cache, const Tensor &v_cache) {
  activation(k_cache, "k_cache");
  dtype_is(v_cache, k_cache.scalar_type(), "v_cache");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                        k_cache.size(1) > 0 && k_cache.size(2) > 0 && k_cache.size(3) > 0,
                    "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
                    "head_dim] with each but num_blocks positive, got ",
                    k_cache.sizes(), " and ", v_cache.sizes());
  same_device(k_cache, v_cache, "v_cache");
  contiguous(k_cache, "k_cache");
  contiguous(v_cache, "v_cache");
}

void index_vector(const Tensor &first, const Tensor &t, at::ScalarType dtype, int64_t dims,
                  const char *name) {
  same_device(first, t, name);
  dtype_is(t, dtype, name);
  TORCH_CHECK_VALUE(t.dim() == dims, name, " must be ", dims, "-d, got ", t.sizes());
  contiguous(t, name);
}

/* Raises what decode attention refused: its status is a code (attention.c) plus 256 times
 * the entry it refused. */
void attention_refused(int64_t status, const optional<Tensor> &seqs, const optional<Tensor> &rows,
                       const Tensor &seq_lens, int64_t block_size, int64_t max_blocks) {
  if (status == 0) return;
  const int64_t code = status % 256, i = status / 256;
  TORCH_CHECK_WITH(OutOfMemoryError, code != 4,
                   "decode attention could not allocate its per-thread scores");
  const int64_t seq = seqs.has_value() ? seqs->data_ptr<int64_t>()[i] : i;
  TORCH_CHECK_VALUE(code != 3, "decode entry ", i, ": sequence ", seq, " or query row ",
                    rows.has_value() ? rows->data_ptr<int64_t>()[i] : seq, " is out of range");
  TORCH_CHECK_VALUE(code != 1, "sequence ", seq, " has seq_len ", seq_lens.data_ptr<int32_t>()[seq],
                    ": not in [1, ", max_blocks, " blocks of ", block_size, "]");
  TORCH_CHECK_VALUE(false, "sequence ", seq, "'s block table names a block outside the cache");
}

template <bool Run>
void decode_attention(const Tensor &query, const Tensor &k_cache, const Tensor &v_cache,
                      const Tensor &block_tables, const Tensor &seq_lens,
                      const optional<Tensor> &seqs, const optional<Tensor> &rows, double scale,
                      int64_t window, double softcap, const Tensor &out) {
  caches(k_cache, v_cache);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t multiple = is_bf16(k_cache) ? 32 : 16; /* whole 512-bit registers */
  TORCH_CHECK_VALUE(head_dim % multiple == 0, "head_dim ", head_dim, " is not a multiple of ",
                    multiple);
  token_rows(k_cache, query, head_dim, "query");
  token_rows(k_cache, out, head_dim, "out");
  dtype_is(query, k_cache.scalar_type(), "query");
  dtype_is(out, k_cache.scalar_type(), "out");
  const int64_t num_tokens = query.size(0), heads = query.size(1);
  TORCH_CHECK_VALUE(heads % kv_heads == 0 && out.sizes() == query.sizes(), "query ", query.sizes(),
                    " and out ", out.sizes(),
                    " must match, with num_heads a multiple of num_kv_heads ", kv_heads);
  index_vector(k_cache, block_tables, at::kInt, 2, "block_tables");
  index_vector(k_cache, seq_lens, at::kInt, 1, "seq_lens");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(block_tables.size(0) == num_seqs, "block_tables has ", block_tables.size(0),
                    " rows for ", num_seqs, " sequences");
  TORCH_CHECK_VALUE(seqs.has_value() == rows.has_value(), "seqs and rows go together");
  int64_t n = num_seqs;
  if (seqs.has_value()) {
    index_vector(k_cache, *seqs, at::kLong, 1, "seqs");
    index_vector(k_cache, *rows, at::kLong, 1, "rows");
    TORCH_CHECK_VALUE(seqs->sizes() == rows->sizes(), "seqs ", seqs->sizes(), " and rows ",
                      rows->sizes());
    n = seqs->size(0);
  }
  TORCH_CHECK_VALUE(window >= 0 && softcap >= 0, "window ", window, " and softcap ", softcap,
                    " must not be negative");
  if (!Run) return;
  const int64_t status = run(kernels().decode_attention, {is_bf16(query),
                                                          ptr(query),
                                                          query.stride(0),
                                                          ptr(k_cache),
                                                          ptr(v_cache),
                                                          num_blocks,
                                                          block_size,
                                                          kv_heads,
                                                          heads / kv_heads,
                                                          head_dim,
                                                          ptr<const int32_t>(block_tables),
                                                          block_tables.size(1),
                                                          ptr<const int32_t>(seq_lens),
                                                          num_seqs,
                                                          ptr<const int64_t>(seqs),
                                                          ptr<const int64_t>(rows),
                                                          n,
                                                          num_tokens,
                                                          scale,
                                                          window,
                                                          softcap,
                                                          ptr(out),
                                                          out.stride(0)});
  attention_refused(status, seqs, rows, seq_lens, block_size, block_tables.size(1));
}

template <bool Run>
void store_kv(const Tensor &key, const Tensor &value, const Tensor &k_cache, const Tensor &v_cache,
              const Tensor &slots) {
  caches(k_cache, v_cache);
  token_rows(k_cache, key, k_cache.size(3), "key");
  token_rows(k_cache, value, k_cache.size(3), "value");
  TORCH_CHECK_VALUE(key.sizes() == value.sizes() && key.size(1) == k_cache.size(2) &&
                        key.scalar_type() == k_cache.scalar_type() &&
                        value.scalar_type() == k_cache.scalar_type(),
                    "key/value ", key.sizes(), " ", key.scalar_type(), " / ", value.sizes(), " ",
                    value.scalar_type(), " do not match the cache's [num_kv_heads, head_dim] = ",
                    k_cache.sizes().slice(2), " ", k_cache.scalar_type());
  index_vector(k_cache, slots, at::kLong, 1, "slot_mapping");
  TORCH_CHECK_VALUE(slots.size(0) == key.size(0), "slot_mapping must be [num_tokens=", key.size(0),
                    "], got ", slots.sizes());
  if (!Run) return;
  const int64_t status =
      run(kernels().store_kv,
          {ptr(key), key.stride(0), ptr(value), value.stride(0), ptr(k_cache), ptr(v_cache),
           k_cache.size(0) * k_cache.size(1), ptr<const int64_t>(slots), key.size(0),
           key.size(1) * key.size(2), static_cast<int64_t>(k_cache.element_size())});
  const int64_t token = status / 256; /* a code plus 256 times the token (attention.c) */
  TORCH_CHECK_VALUE(status == 0, "token ", token, "'s slot ", slots.data_ptr<int64_t>()[token],
                    " is outside the cache");
}

/* A norm's rows x [n, d], its [d] parameters, residual and out [n, d]: one dtype. */
void norm_arguments(const Tensor &x, const optional<Tensor> &residual,
                    std::initializer_list<std::pair<const Tensor *, const char *>> params,
                    const Tensor &out) {
  activation(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [n, d], got ", x.sizes());
  contiguous(x, "x");
  for (const auto &[p, name] : params) exactly(x, *p, x.scalar_type(), {x.size(1)}, name);
  if (residual.has_value()) exactly(x, *residual, x.scalar_type(), x.sizes(), "residual");
  exactly(x, out, x.scalar_type(), x.sizes(), "out");
}

template <bool Run>
void rms_norm(const Tensor &x, const optional<Tensor> &residual, const Tensor &weight,
              const Tensor &out, double eps) {
  norm_arguments(x, residual, {{&weight, "weight"}}, out);
  if (!Run) return;
  const Kernels &k = kernels();
  const int64_t n = x.size(0), d = x.size(1);
  if (is_bf16(x))
    run(k.rms_norm_bf16, {ptr<const bf16_t>(x), ptr<bf16_t>(residual), ptr<const bf16_t>(weight),
                          ptr<bf16_t>(out), n, d, eps});
  else
    run(k.rms_norm_f32, {ptr<const float>(x), ptr<float>(residual), ptr<const float>(weight),
                         ptr<float>(out), n, d, eps});
}

template <bool Run>
void layer_norm(const Tensor &x, const optional<Tensor> &residual, const Tensor &weight,
                const Tensor &bias, const Tensor &out, double eps) {
  norm_arguments(x, residual, {{&weight, "weight"}, {&bias, "bias"}}, out);
  if (!Run) return;
  const Kernels &k = kernels();
  const int64_t n = x.size(0), d = x.size(1);
  if (is_bf16(x))
    run(k.layer_norm_bf16, {ptr<const bf16_t>(x), ptr<bf16_t>(residual), ptr<const bf16_t>(weight),
                            ptr<const bf16_t>(bias), ptr<bf16_t>(out), n, d, eps});
  else
    run(k.layer_norm_f32, {ptr<const float>(x), ptr<float>(residual), ptr<const float>(weight),
                           ptr<const float>(bias), ptr<float>(out), n, d, eps});
}

/* Rotates in place the first `heads` heads of each row of x; nothing when a position falls
 * outside the table. */
template <bool Run>
void rope(const Tensor &x, const Tensor &table, const Tensor &positions, int64_t heads,
          int64_t head_dim) {
  activation(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1,
                    "x must be [n, row] with unit column stride, got ", x.sizes(), " strides ",
                    x.strides());
  /* heads * head_dim bounded by the row before it is formed: no product overflows */
  TORCH_CHECK_VALUE(
      heads >= 0 && head_dim > 0 && head_dim <= x.size(1) && heads <= x.size(1) / head_dim,
      "heads ", heads, " of head_dim ", head_dim, " do not fit rows of ", x.size(1));
  TORCH_CHECK_VALUE(x.size(0) <= 1 || x.stride(0) >= heads * head_dim,
                    "x must be rows of >= ", heads * head_dim, " elements apart, got strides ",
                    x.strides());
  TORCH_CHECK_VALUE(table.dim() == 3, "table must be [rows, 2, rot], got ", table.sizes());
  const int64_t rot = table.size(2);
  TORCH_CHECK_VALUE(rot <= head_dim && rot % 2 == 0 && rot <= 1024, "rotary width ", rot,
                    " must be even and <= head_dim ", head_dim);
  exactly(x, table, x.scalar_type(), {table.size(0), 2, rot}, "table");
  exactly(x, positions, at::kLong, {x.size(0)}, "positions");
  if (!Run) return;
  const Kernels &k = kernels();
  const int64_t n = x.size(0), rows = table.size(0), stride = x.stride(0);
  const int64_t outside =
      is_bf16(x)
          ? run(k.rope_bf16, {ptr<bf16_t>(x), ptr<const bf16_t>(table), rows,
                              ptr<const int64_t>(positions), n, heads, head_dim, stride, rot})
          : run(k.rope_f32, {ptr<float>(x), ptr<const float>(table), rows,
                             ptr<const int64_t>(positions), n, heads, head_dim, stride, rot});
  TORCH_CHECK_VALUE(outside == 0, outside, " of ", n, " positions fall outside the rotary table's ",
                    rows, " rows");
}

template <bool Run>
void silu_mul(const Tensor &gate_up, const Tensor &out) {
  activation(gate_up, "gate_up");
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
                    "gate_up must be [n, 2 * inter], got ", gate_up.sizes());
  contiguous(gate_up, "gate_up");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  exactly(gate_up, out, gate_up.scalar_type(), {n, inter}, "out");
  if (!Run) return;
  const Kernels &k = kernels();
  if (is_bf16(gate_up))
    run(k.silu_mul_bf16, {ptr<const bf16_t>(gate_up), ptr<bf16_t>(out), n, inter});
  else
    run(k.silu_mul_f32, {ptr<const float>(gate_up), ptr<float>(out), n, inter});
}

template <bool Run>
void gelu_tanh(const Tensor &x, const Tensor &out) {
  activation(x, "x");
  contiguous(x, "x");
  exactly(x, out, x.scalar_type(), x.sizes(), "out");
  if (!Run) return;
  const Kernels &k = kernels();
  if (is_bf16(x))
    run(k.gelu_tanh_bf16, {ptr<const bf16_t>(x), ptr<bf16_t>(out), x.numel()});
  else
    run(k.gelu_tanh_f32, {ptr<const float>(x), ptr<float>(out), x.numel()});
}

template <bool Run>
void argmax_rows(const Tensor &x, const Tensor &out) {
  dtype_is(x, at::kFloat, "x");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1,
                    "x must be [rows, cols] with unit column "
                    "stride, got ",
                    x.sizes(), " strides ", x.strides());
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK_VALUE(cols > 0 && cols < (int64_t{1} << 31), "cols ", cols, " must be in [1, 2^31)");
  exactly(x, out, at::kLong, {rows}, "out");
  if (!Run || rows == 0) return;
  run(kernels().argmax_rows_f32, {ptr<const float>(x), rows, cols, x.stride(0), ptr<int64_t>(out)});
}

/* A quantized weight: codes [rows, k / 2] uint8 (q4) or [rows, k] int8 (q8), scales and
 * mins [rows, k / group] float16 or float32, rows at least `n` (interleaved: a multiple
 * of 16 at least n); returns whether the codes are q4. */
bool quantized_weight(const Tensor &codes, const Tensor &scales, const optional<Tensor> &mins,
                      int64_t n, int64_t k, int64_t group, bool interleaved) {
  const bool q4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK_TYPE(q4 || codes.scalar_type() == at::kChar,
                   "codes must be uint8 (q4) or int8 "
                   "(q8), got ",
                   codes.scalar_type());
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat,
                   "scales must be float16 or float32, got ", scales.scalar_type());
  TORCH_CHECK_VALUE(group > 0 && k > 0 && k % group == 0 && (!q4 || k % 64 == 0), "k ", k,
                    " must be a positive multiple of the group ", group,
                    q4 ? " and of 64 (q4 codes)" : "");
  TORCH_CHECK_VALUE(codes.dim() == 2, "codes must be 2-D, got ", codes.sizes());
  const int64_t rows = codes.size(0);
  TORCH_CHECK_VALUE(n >= 0 && rows >= n && (!interleaved || rows % 16 == 0), "codes of ", rows,
                    " rows do not hold ", n, interleaved ? " rows in groups of 16" : " rows");
  shape_is(codes, {rows, q4 ? k / 2 : k}, "codes");
  contiguous(codes, "codes");
  exactly(codes, scales, scales.scalar_type(), {rows, k / group}, "scales");
  if (mins.has_value()) exactly(codes, *mins, scales.scalar_type(), scales.sizes(), "mins");
  return q4;
}

/* One product of one layout: each layout's struct types its codes and scales. */
template <typename Args>
int64_t qlinear_call(int64_t (*fn)(const Args *), const Tensor &x, const Tensor &codes,
                     const Tensor &scales, const optional<Tensor> &mins,
                     const optional<Tensor> &bias, const Tensor &y, int64_t group,
                     bool interleaved) {
  using C = decltype(Args::codes);
  using S = decltype(Args::scales);
  return run(fn, {ptr(x), static_cast<C>(ptr(codes)), static_cast<S>(ptr(scales)),
                  static_cast<S>(ptr(mins)), ptr(bias), ptr(y), x.size(0), y.size(1), x.size(1),
                  group, interleaved, is_bf16(x)});
}

template <typename Args>
int64_t dequant_call(int64_t (*fn)(const Args *), const Tensor &codes, const Tensor &scales,
                     const optional<Tensor> &mins, const optional<Tensor> &ids, int64_t row0,
                     int64_t n, int64_t k, int64_t group, bool interleaved, const Tensor &out) {
  using C = decltype(Args::codes);
  using S = decltype(Args::scales);
  return run(
      fn, {static_cast<C>(ptr(codes)), static_cast<S>(ptr(scales)), static_cast<S>(ptr(mins)),
           ptr<const int64_t>(ids), out.size(0), row0, ptr<float>(out), n, k, group, interleaved});
}

/* y [m, n] = x [m, k] W^T + bias: x, bias and y float32, or all bfloat16. */
template <bool Run>
void qlinear(const Tensor &x, const Tensor &codes, const Tensor &scales,
             const optional<Tensor> &mins, const optional<Tensor> &bias, const Tensor &y,
             int64_t group, bool interleaved) {
  activation(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2 && y.dim() == 2, "x and y must be 2-D, got ", x.sizes(), " and ",
                    y.sizes());
  contiguous(x, "x");
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  same_device(x, codes, "codes");
  const bool q4 = quantized_weight(codes, scales, mins, n, k, group, interleaved);
  exactly(x, y, x.scalar_type(), {m, n}, "y");
  if (bias.has_value()) exactly(x, *bias, x.scalar_type(), {n}, "bias");
  if (!Run || m == 0) return;
  const Kernels &kn = kernels();
  const bool f16 = scales.scalar_type() == at::kHalf;
  const auto call = [&](auto fn) {
    return qlinear_call(fn, x, codes, scales, mins, bias, y, group, interleaved);
  };
  const int64_t status = q4 ? (f16 ? call(kn.qlinear_q4_f16) : call(kn.qlinear_q4_f32))
                            : (f16 ? call(kn.qlinear_q8_f16) : call(kn.qlinear_q8_f32));
  TORCH_CHECK_WITH(OutOfMemoryError, status != -1, "no scratch memory for a quantized product");
  TORCH_CHECK_VALUE(status == 0, "the kernel refused W: ", interleaved ? "interleaved" : "in rows",
                    ", where its product (group ", group, ", k ", k, ") reads the other layout");
}

/* out [r, k] float32 = W[ids] (ids int64 [r]), or W[row0 : row0 + r] of W's n rows. */
template <bool Run>
void dequant(const Tensor &codes, const Tensor &scales, const optional<Tensor> &mins,
             const optional<Tensor> &ids, int64_t row0, int64_t n, int64_t k, int64_t group,
             bool interleaved, const Tensor &out) {
  const bool q4 = quantized_weight(codes, scales, mins, n, k, group, interleaved);
  TORCH_CHECK_VALUE(out.dim() == 2, "out must be [rows, k], got ", out.sizes());
  const int64_t rows = out.size(0);
  exactly(codes, out, at::kFloat, {rows, k}, "out");
  if (ids.has_value()) {
    exactly(codes, *ids, at::kLong, {rows}, "ids");
  } else {
    TORCH_CHECK_VALUE(row0 >= 0 && row0 <= n - rows, "rows ", row0, ":", row0 + rows,
                      " are outside [0, ", n, ")");
  }
  if (!Run || rows == 0) return;
  const Kernels &kn = kernels();
  const bool f16 = scales.scalar_type() == at::kHalf;
  const auto call = [&](auto fn) {
    return dequant_call(fn, codes, scales, mins, ids, row0, n, k, group, interleaved, out);
  };
  const int64_t status = q4 ? (f16 ? call(kn.dequant_q4_f16) : call(kn.dequant_q4_f32))
                            : (f16 ? call(kn.dequant_q8_f16) : call(kn.dequant_q8_f32));
  /* 1 + the index of the first id outside [0, n) */
  TORCH_CHECK_INDEX(status == 0, "row ", status ? ids->data_ptr<int64_t>()[status - 1] : 0,
                    " is outside [0, ", n, ")");
}

/* ---- Call lists ---- */

void record_start() {
  TORCH_CHECK(recording == nullptr, "this thread is already recording");
  recording = new std::vector<int64_t>();
}

Tensor record_stop() {
  TORCH_CHECK(recording != nullptr, "this thread is not recording");
  std::vector<int64_t> *list = recording;
  recording = nullptr;
  Tensor calls = at::empty({static_cast<int64_t>(list->size())}, at::kLong);
  std::memcpy(calls.data_ptr(), list->data(), list->size() * sizeof(int64_t));
  delete list;
  return calls;
}

/* Runs the calls of a list record_stop made, in order; returns the first nonzero status
 * (the calls after it do not run). Its functions and pointers are run as they stand: a
 * list from anywhere else is not checked beyond its framing. */
int64_t run_calls(const Tensor &calls) {
  index_vector(calls, calls, at::kLong, 1, "calls");
  const int64_t *list = calls.data_ptr<int64_t>();
  const int64_t len = calls.numel();
  for (int64_t i = 0; i < len; i += 2 + list[i + 1])
    TORCH_CHECK_VALUE(i + 2 <= len && list[i + 1] > 0 && list[i + 1] <= len - i - 2,
                      "a malformed call list");
  using Fn = int64_t (*)(const void *);
  for (int64_t i = 0; i < len; i += 2 + list[i + 1]) {
    const int64_t status = reinterpret_cast<Fn>(static_cast<intptr_t>(list[i]))(list + i + 2);
    if (status) return status;
  }
  return 0;
}

}  // namespace

/* ---- Choosing the build (plain C, for ctypes) ---- */

/* Loads the kernel library at `path` and runs its kernels from now on; has_bf16: the CPU
 * runs its bf16 linear product. Returns 0, or 1 with the reason in `error`. A build once
 * loaded stays loaded: recorded call lists hold its functions. */
extern "C" int flowllm_ops_use(const char *path, int has_bf16, char *error, size_t size) {
  static std::mutex lock;
  static std::map<std::pair<std::string, bool>, Kernels *> loaded;
  std::lock_guard<std::mutex> guard(lock);
  Kernels *&k = loaded[{path, has_bf16 != 0}];
  if (k == nullptr) {
    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      snprintf(error, size, "%s", dlerror());
      return 1;
    }
    auto *bound = new Kernels();
#define FLOWLLM_BIND(kernel, ...)                                                                \
  bound->kernel = reinterpret_cast<decltype(bound->kernel)>(dlsym(library, "flowllm_" #kernel)); \
  if (bound->kernel == nullptr && std::strcmp(#kernel, "linear_bf16") != 0) {                    \
    snprintf(error, size, "%s lacks flowllm_" #kernel, path);                                    \
    delete bound;                                                                                \
    return 1;                                                                                    \
  }
    FLOWLLM_KERNELS(FLOWLLM_BIND)
#undef FLOWLLM_BIND
    bound->has_bf16 = has_bf16 != 0 && bound->linear_bf16 != nullptr; /* not in the AVX2 build */
    k = bound;
  }
  active.store(k);
  return 0;
}

/* No build: the ops refuse to run (the torch paths serve instead). */
extern "C" void flowllm_ops_clear(void) { active.store(nullptr); }

TORCH_LIBRARY(flowllm, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias, Tensor(a!) y) -> ()");
  m.def(
      "decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor? seqs, Tensor? rows, float scale, int window, float softcap, "
      "Tensor(a!) out) -> ()");
  m.def(
      "store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, Tensor(b!) out, float eps) -> ()");
  m.def(
      "layer_norm(Tensor x, Tensor(a!)? residual, Tensor weight, Tensor bias, Tensor(b!) out, "
      "float eps) -> ()");
  m.def("rope(Tensor(a!) x, Tensor table, Tensor positions, int heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("gelu_tanh(Tensor x, Tensor(a!) out) -> ()");
  m.def("argmax_rows(Tensor x, Tensor(a!) out) -> ()");
  m.def(
      "qlinear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, Tensor(a!) y, "
      "int group, bool interleaved) -> ()");
  m.def(
      "dequant(Tensor codes, Tensor scales, Tensor? mins, Tensor? ids, int row0, int n, int k, "
      "int group, bool interleaved, Tensor(a!) out) -> ()");
  m.def("record_start() -> ()", &record_start);
  m.def("record_stop() -> Tensor", &record_stop);
  m.def("run_calls(Tensor calls) -> int");
}

#define FLOWLLM_IMPLS(m, RUN)                         \
  m.impl("linear", &linear<RUN>);                     \
  m.impl("decode_attention", &decode_attention<RUN>); \
  m.impl("store_kv", &store_kv<RUN>);                 \
  m.impl("rms_norm", &rms_norm<RUN>);                 \
  m.impl("layer_norm", &layer_norm<RUN>);             \
  m.impl("rope", &rope<RUN>);                         \
  m.impl("silu_mul", &silu_mul<RUN>);                 \
  m.impl("gelu_tanh", &gelu_tanh<RUN>);               \
  m.impl("argmax_rows", &argmax_rows<RUN>);           \
  m.impl("qlinear", &qlinear<RUN>);                   \
  m.impl("dequant", &dequant<RUN>)

TORCH_LIBRARY_IMPL(flowllm, CPU, m) {
  FLOWLLM_IMPLS(m, true);
  m.impl("run_calls", &run_calls);
}

TORCH_LIBRARY_IMPL(flowllm, Meta, m) { FLOWLLM_IMPLS(m, false); }
