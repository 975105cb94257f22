// Attention over explicit lists of KV-pool slots on CPU: decode, verify and the sparse draft.
// (Layout and semantics: magicdec_kernels/cpu_native.py.)
//
// At long context, decode and verify cost one read of every key and value a request attends to,
// so this kernel reads each (request, KV head)'s keys and values once for all of the request's
// query rows times the query heads of the GQA group (q_len x group rows, up to kMaxRows per
// task), straight from the pool by slot index, with an online softmax over blocks of two vectors
// of keys. Per block, the keys are transposed to [D, keys] in L1, so each row's scores are a few
// vectors of broadcast-FMAs over d, and each value row is loaded once for all rows of the task:
// both products are small GEMM micro-kernels with the accumulators in registers. With bf16
// queries and KV on a CPU with AVX512-BF16 ("avx512bf16"), both products are bf16 pair dot
// products instead (`Bf16Dot`): twice the multiply-adds per instruction, where verify's 12 rows
// per KV head are compute-bound.
//
// Work is split into (request, KV head, row tile, key chunk) tasks that threads pull from a shared
// counter inside at::parallel_for, so one long request still keeps every core streaming. Chunks of
// a row tile produce a normalised partial output and log-sum-exp each, merged exactly afterwards:
// out = sum_c exp(lse_c - lse) * out_c.
//
// The kernel body (slot_attention_body.h) is compiled once per instruction set by
// multiversion.h, like every kernel here; the entry point below runs the set `resolve_isa` picks.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa.h"

namespace {

// Rows (q_len x group) one task computes per read of its keys: verify's 8 tokens x 4 heads.
constexpr int kMaxRows = 32;
// Widest vector (AVX-512 floats), and the largest block of keys (two vectors).
constexpr int kMaxWidth = 16;
constexpr int kMaxBlock = 2 * kMaxWidth;
// Lists longer than this are split into chunks of this many keys (whole blocks), so that one long
// request keeps every core busy. The boundaries fall at multiples of it whatever else is in the
// batch: a row's result depends only on its own list, not on its batch or the rows beside it.
constexpr int64_t kChunkKeys = 2048;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using magicdec::bf16_bits;

// Where the keys and values are: element pointers and strides (in elements) of the pool.
struct Pool {
  const void* k;
  const void* v;
  int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
  int64_t num_slots;
  int head_dim, v_dim;
};

// One thread's working set, reused across its tasks (a few tens of KiB: stays in L1/L2).
struct Scratch {
  float* q;    // [kMaxRows, D] the task's query rows, times scale * log2(e)
  float* kt;   // [D, KB] the block's keys, transposed
  float* s;    // [kMaxRows, KB] the block's scores, then its probabilities
  float* acc;  // [kMaxRows, Dv] un-normalised output rows
  float* l_lanes;  // [kMaxRows, W] running sums of 2^(score - m), spread over the lanes
  const void* zeros;  // max(D, Dv) zero floats: stands in for the missing keys of a last block
  // The bf16 dot-product path (both operands bf16): q as given, its scale applied to the scores;
  // keys as [D / 2, KB] pairs of dims (kt's storage), values as [KB / 2, Dv] pairs of keys.
  bf16_bits* q16;  // [kMaxRows, D]
  uint32_t* vt2;   // [KB / 2, Dv]
  float score_scale;  // scale * log2(e)
  // Scores are in log2 units: q is pre-multiplied by scale * log2(e).
  float m[kMaxRows];      // running max of each row's scores
  float l[kMaxRows];      // sum of 2^(score - m) (set at the end of a task)
  float alpha[kMaxRows];  // this block's rescale of acc: 2^(m_old - m_new)
  int64_t visible[kMaxRows];  // keys of the list row r may see (causal, aligned to the end)
  int64_t max_visible;

  std::unique_ptr<float, decltype(&std::free)> storage{nullptr, &std::free};

  Scratch(int head_dim, int v_dim) {
    const size_t q_n = size_t(kMaxRows) * head_dim, kt_n = size_t(head_dim) * kMaxBlock;
    const size_t s_n = size_t(kMaxRows) * kMaxBlock, acc_n = size_t(kMaxRows) * v_dim;
    const size_t l_n = size_t(kMaxRows) * kMaxWidth, zeros_n = std::max(head_dim, v_dim);
    const size_t q16_n = q_n / 2, vt2_n = size_t(kMaxBlock / 2) * v_dim;
    const size_t total = q_n + kt_n + s_n + acc_n + l_n + zeros_n + q16_n + vt2_n;
    // Every piece is a multiple of 16 floats, so 64-byte alignment of the whole aligns each.
    storage.reset(static_cast<float*>(std::aligned_alloc(64, total * sizeof(float))));
    TORCH_CHECK(storage, "slot_attention: out of memory for scratch");
    q = storage.get();
    kt = q + q_n;
    s = kt + kt_n;
    acc = s + s_n;
    l_lanes = acc + acc_n;
    float* zero_floats = l_lanes + l_n;
    std::fill(zero_floats, zero_floats + zeros_n, 0.0f);
    zeros = zero_floats;
    q16 = reinterpret_cast<bf16_bits*>(zero_floats + zeros_n);
    vt2 = reinterpret_cast<uint32_t*>(zero_floats + zeros_n + q16_n);
  }
};

// Attend rows [0, rows) of the scratch over list[key_begin:key_end) of KV head `head`, leaving
// acc (un-normalised), m and l. False if a slot was outside the pool (read as a zero key).
using AttendFn = bool (*)(const Pool&, const int64_t* list, int64_t list_stride, int64_t head,
                          int rows, int64_t key_begin, int64_t key_end, Scratch& sc);

// One instruction set's attention: float32 KV, bf16 KV widened to float32, and bf16 q and KV as
// bf16 pair dot products (head dim a multiple of 32; null where the set has no `vdpbf16ps`).
struct AttendFns {
  AttendFn f32;
  AttendFn bf16;
  AttendFn bf16_dot;
};

}  // namespace

#define MAGICDEC_KERNEL_BODY "slot_attention_body.h"
#include "multiversion.h"

// ---------------------------------------------------------------------------------------------
// Planning, threads, merging and the entry point (instruction-set independent; the Python
// binding is in module.cpp).

namespace {

// A piece of work: rows [row_begin, row_end) (row = token * group + head in group) of request b,
// KV head h, over keys [key_begin, key_end) of its list.
struct Task {
  int64_t b, h;
  int row_begin, row_end;
  int64_t key_begin, key_end;
  int64_t part_row;  // first row of this chunk in the partial buffers; -1: write `out` directly
};

// A row tile whose keys were split into chunks: its partial rows are merged into `out`.
struct Split {
  int64_t b, h;
  int row_begin, row_end;
  int64_t part_row;  // chunk c's rows start at part_row + c * (row_end - row_begin)
  int chunks;
};

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
void store_row(T* dst, const float* src, int n, float factor) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * factor);
}

template <typename QT>
void run_all(const torch::Tensor& q, const Pool& pool, const torch::Tensor& head_slots,
             const std::vector<int64_t>& q_start, const std::vector<int64_t>& q_len,
             const std::vector<int64_t>& kv_len, int64_t num_kv_heads, int group, float scale,
             torch::Tensor& out, AttendFn attend, bool bf16_dot) {
  const int64_t batch = int64_t(q_len.size());
  const int D = pool.head_dim, Dv = pool.v_dim;
  const int threads = std::max(1, at::get_num_threads());
  const float scale_log2 = scale * 1.4426950408889634f;  // scores in log2 units: exp2 is cheaper

  // Row tiles of at most kMaxRows rows, balanced in size.
  std::vector<Task> tiles;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t rows = q_len[b] * group;
    if (rows == 0) continue;
    const int64_t n_tiles = (rows + kMaxRows - 1) / kMaxRows;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t t = 0; t < n_tiles; ++t) {
        const int row_begin = int(rows * t / n_tiles), row_end = int(rows * (t + 1) / n_tiles);
        const int64_t last_token = (row_end - 1) / group;
        const int64_t keys =
            std::clamp<int64_t>(kv_len[b] - q_len[b] + last_token + 1, 0, kv_len[b]);
        tiles.push_back({b, h, row_begin, row_end, 0, keys, -1});
      }
    }
  }

  std::vector<Task> tasks;
  std::vector<Split> splits;
  int64_t part_rows = 0;
  for (const Task& tile : tiles) {
    const int64_t chunks = std::max<int64_t>(1, (tile.key_end + kChunkKeys - 1) / kChunkKeys);
    if (chunks == 1) {
      tasks.push_back(tile);
      continue;
    }
    const int rows = tile.row_end - tile.row_begin;
    splits.push_back({tile.b, tile.h, tile.row_begin, tile.row_end, part_rows, int(chunks)});
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = c * kChunkKeys;
      const int64_t end = std::min(begin + kChunkKeys, tile.key_end);
      tasks.push_back({tile.b, tile.h, tile.row_begin, tile.row_end, begin, end, part_rows});
      part_rows += rows;
    }
  }
  // Largest first (cost ~ keys x (rows + the per-key work independent of rows)), so the
  // threads pulling tasks finish together.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) {
    return (x.key_end - x.key_begin) * (x.row_end - x.row_begin + 8) >
           (y.key_end - y.key_begin) * (y.row_end - y.row_begin + 8);
  });

  // Each chunk's normalised output rows and log-sum-exp (log2 units).
  std::vector<float> part_out(size_t(part_rows) * Dv), part_lse(part_rows);
  const QT* q_data = q.data_ptr<QT>();
  QT* out_data = out.data_ptr<QT>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t* slots_data = head_slots.data_ptr<int64_t>();
  const int64_t sl_s0 = head_slots.stride(0), sl_s2 = head_slots.stride(2);
  const int64_t sl_s1 = head_slots.size(1) == 1 ? 0 : head_slots.stride(1);

  auto run_task = [&](const Task& task, Scratch& sc) -> bool {
    const int rows = task.row_end - task.row_begin;
    const int64_t b = task.b;
    sc.max_visible = 0;
    sc.score_scale = scale_log2;
    for (int r = 0; r < rows; ++r) {
      const int64_t row = task.row_begin + r, token = row / group;
      const int64_t head = task.h * group + row % group;
      const QT* src = q_data + (q_start[b] + token) * q_s0 + head * q_s1;
      if constexpr (std::is_same_v<QT, c10::BFloat16>) {
        if (bf16_dot) {
          for (int d = 0; d < D; ++d) sc.q16[r * D + d] = src[d].x;
        }
      }
      if (!bf16_dot) {
        for (int d = 0; d < D; ++d) sc.q[r * D + d] = to_float(src[d]) * scale_log2;
      }
      sc.visible[r] = std::clamp<int64_t>(kv_len[b] - q_len[b] + token + 1, 0, kv_len[b]);
      sc.max_visible = std::max(sc.max_visible, sc.visible[r]);
      sc.m[r] = kNegInf;
      sc.l[r] = 0.0f;
    }
    std::fill(sc.acc, sc.acc + size_t(rows) * Dv, 0.0f);
    const int64_t* list = slots_data + b * sl_s0 + task.h * sl_s1;
    const bool ok = attend(pool, list, sl_s2, task.h, rows, task.key_begin, task.key_end, sc);
    for (int r = 0; r < rows; ++r) {
      const float* acc = sc.acc + size_t(r) * Dv;
      const bool seen = sc.l[r] > 0.0f;
      const float inv = seen ? 1.0f / sc.l[r] : 0.0f;
      if (task.part_row < 0) {
        const int64_t row = task.row_begin + r, token = row / group;
        const int64_t head = task.h * group + row % group;
        store_row(out_data + (q_start[b] + token) * o_s0 + head * o_s1, acc, Dv, inv);
      } else {
        store_row(part_out.data() + size_t(task.part_row + r) * Dv, acc, Dv, inv);
        part_lse[task.part_row + r] = seen ? sc.m[r] + std::log2(sc.l[r]) : kNegInf;
      }
    }
    return ok;
  };

  std::atomic<int64_t> next{0};
  std::atomic<bool> bad_slot{false};
  const int64_t n_tasks = int64_t(tasks.size());
  // Each thread pulls tasks until none are left: dynamic balance over the static split of
  // at::parallel_for (a nested call runs inline, and then one "thread" takes everything).
  at::parallel_for(0, std::min<int64_t>(threads, n_tasks), 1, [&](int64_t, int64_t) {
    Scratch sc(D, Dv);
    for (int64_t i = next.fetch_add(1); i < n_tasks; i = next.fetch_add(1)) {
      if (!run_task(tasks[i], sc)) bad_slot.store(true);
    }
  });
  TORCH_CHECK(!bad_slot.load(), "slot_attention: head_slots holds a slot outside the KV pool");

  // Merge the chunks of each split row tile: out = sum_c 2^(lse_c - lse) out_c (log2 units).
  std::vector<float> merged(Dv);
  for (const Split& split : splits) {
    const int rows = split.row_end - split.row_begin;
    for (int r = 0; r < rows; ++r) {
      float top = kNegInf;
      for (int c = 0; c < split.chunks; ++c) {
        top = std::max(top, part_lse[split.part_row + int64_t(c) * rows + r]);
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      if (top > kNegInf) {
        for (int c = 0; c < split.chunks; ++c) {
          const int64_t part = split.part_row + int64_t(c) * rows + r;
          const float w = std::exp2(part_lse[part] - top);
          total += w;
          const float* src = part_out.data() + size_t(part) * Dv;
          for (int d = 0; d < Dv; ++d) merged[d] += w * src[d];
        }
      }
      const int64_t row = split.row_begin + r, token = row / group;
      const int64_t head = split.h * group + row % group;
      QT* dst = out_data + (q_start[split.b] + token) * o_s0 + head * o_s1;
      store_row(dst, merged.data(), Dv, total > 0.0f ? 1.0f / total : 0.0f);
    }
  }
}

}  // namespace

namespace magicdec {


torch::Tensor slot_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& q_indptr,
                             const torch::Tensor& head_slots, const torch::Tensor& kv_lens,
                             double scale, torch::Tensor out, const std::string& isa) {
  using TensorList = std::initializer_list<const torch::Tensor*>;
  for (const torch::Tensor* t : TensorList{&q, &k_cache, &v_cache, &q_indptr, &head_slots,
                                           &kv_lens, &out}) {
    TORCH_CHECK(t->device().is_cpu(), "slot_attention: all tensors must be on the CPU");
  }
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.dim() == 3,
              "slot_attention: q, k_cache, v_cache and out must be 3-D");
  const auto q_type = q.scalar_type(), kv_type = k_cache.scalar_type();
  TORCH_CHECK(q_type == at::kFloat || q_type == at::kBFloat16,
              "slot_attention: q must be float32 or bfloat16");
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16,
              "slot_attention: the KV cache must be float32 or bfloat16");
  TORCH_CHECK(v_cache.scalar_type() == kv_type,
              "slot_attention: k_cache and v_cache dtypes differ");
  TORCH_CHECK(out.scalar_type() == q_type, "slot_attention: out must have q's dtype");
  const int64_t num_q = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_slots = k_cache.size(0), num_kv_heads = k_cache.size(1);
  const int64_t v_dim = v_cache.size(2);
  TORCH_CHECK(k_cache.size(2) == head_dim, "slot_attention: q and k_cache head dims differ");
  TORCH_CHECK(v_cache.size(0) == num_slots && v_cache.size(1) == num_kv_heads,
              "slot_attention: k_cache and v_cache pools differ in shape");
  TORCH_CHECK(head_dim % 16 == 0 && v_dim % 16 == 0 && head_dim > 0 && v_dim > 0,
              "slot_attention: head dims must be positive multiples of 16");
  TORCH_CHECK(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0,
              "slot_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(out.size(0) == num_q && out.size(1) == num_q_heads && out.size(2) == v_dim,
              "slot_attention: out must be [num_q, num_q_heads, v_dim]");
  for (const torch::Tensor* t : TensorList{&q, &k_cache, &v_cache, &out}) {
    TORCH_CHECK(t->size(2) <= 1 || t->stride(2) == 1,
                "slot_attention: the last dim of q, k_cache, v_cache and out must be contiguous");
  }
  TORCH_CHECK(q_indptr.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong &&
                  head_slots.scalar_type() == at::kLong,
              "slot_attention: q_indptr, head_slots and kv_lens must be int64");
  const int64_t batch = kv_lens.numel();
  TORCH_CHECK(q_indptr.dim() == 1 && q_indptr.numel() == batch + 1,
              "slot_attention: q_indptr must be [batch + 1]");
  TORCH_CHECK(head_slots.dim() == 3 && head_slots.size(0) == batch &&
                  (head_slots.size(1) == num_kv_heads || head_slots.size(1) == 1),
              "slot_attention: head_slots must be [batch, num_kv_heads or 1, width]");

  const torch::Tensor indptr_c = q_indptr.contiguous(), lens_c = kv_lens.contiguous();
  const int64_t* indptr = indptr_c.data_ptr<int64_t>();
  const int64_t* lens = lens_c.data_ptr<int64_t>();
  std::vector<int64_t> q_start(batch), q_len(batch), kv_len(batch);
  for (int64_t b = 0; b < batch; ++b) {
    q_start[b] = indptr[b];
    q_len[b] = indptr[b + 1] - indptr[b];
    kv_len[b] = lens[b];
    TORCH_CHECK(q_len[b] >= 0 && q_start[b] >= 0 && indptr[b + 1] <= num_q,
                "slot_attention: q_indptr must be non-decreasing within q's rows");
    TORCH_CHECK(kv_len[b] >= 0 && kv_len[b] <= head_slots.size(2),
                "slot_attention: kv_lens must lie in [0, head_slots.size(2)]");
  }

  const AttendFns chosen = pick(resolve_isa(isa, "slot_attention"), MAGICDEC_PER_ISA(kAttend));
  const Pool pool{k_cache.data_ptr(),   v_cache.data_ptr(),   k_cache.stride(0),
                  k_cache.stride(1),    v_cache.stride(0),    v_cache.stride(1),
                  num_slots,            int(head_dim),        int(v_dim)};
  const bool bf16_dot = chosen.bf16_dot != nullptr && q_type == at::kBFloat16 &&
                        kv_type == at::kBFloat16 && head_dim % 32 == 0;
  const AttendFn attend = bf16_dot                ? chosen.bf16_dot
                          : kv_type == at::kFloat ? chosen.f32
                                                  : chosen.bf16;
  const int group = int(num_q_heads / num_kv_heads);
  const float scale_f = float(scale);
  if (q_type == at::kFloat) {
    run_all<float>(q, pool, head_slots, q_start, q_len, kv_len, num_kv_heads, group, scale_f, out,
                   attend, bf16_dot);
  } else {
    run_all<c10::BFloat16>(q, pool, head_slots, q_start, q_len, kv_len, num_kv_heads, group,
                           scale_f, out, attend, bf16_dot);
  }
  return out;
}

}  // namespace magicdec
