// One MoE layer in one call, for decode-sized batches (llmhal_cpu/moe.py): the routing and the
// routed experts.
//
// Through torch, a decode step of a MoE layer is ~10 ops of routing (softmax or sigmoid, top-k,
// grouped top-k, renormalisation) and ~10 of bookkeeping (argsort, bincount, a host sync, gathers,
// index_add), plus four tensor calls per active expert (two matmuls, the activation, a copy),
// each a few microseconds of dispatch around a matmul that at 1-8 rows is a matrix-vector
// product. Any of those torch calls also keeps the step from being recorded as a step graph
// (llmhal_cpu/step_graph.py). Here the whole layer is one call: each token's experts are chosen
// from its router logits exactly as torch's select_experts chooses them (ties in torch.topk's
// order), the (token, choice) pairs are grouped by expert with a counting sort, and each active
// expert's weight rows are streamed once for all of its tokens (a dot product per token per row,
// float32 accumulation), gate/up -> silu(gate) * up -> down, each token's result added into its
// output row times its routing weight.
//
// Weights are float32, bfloat16 (widened to float32 in registers) or int8 with one float32 scale
// per output row (experts_int8); activations and logits float32 or bfloat16 (widened here).
// Intermediates stay float32 (torch's bf16 path rounds gate/up and the activation to bf16: this
// is closer to the float32 result), except on the bf16 dots (bf16 or int8 weights with bf16
// activations on AVX512-BF16 hosts: expert_block_bf16), which round silu(gate) * up to bf16 as
// torch does; the output is rounded once to the activations' dtype.
//
// Rows of a projection are split over the caller's OpenMP team when there is enough work; the
// team size is always the caller's (num_threads(threads)) and serial runs go through if(), for
// the reason given in attention/paged_attention.cpp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>

#include "dot_rows.h"
#include "float_bits.h"

namespace {

using llmhal_cpu::dots;
#if defined(__AVX512BF16__)
using llmhal_cpu::dots2_bf16;
#endif
using llmhal_cpu::exp_approx;
using llmhal_cpu::f32_to_bf16_bits;
using llmhal_cpu::kRowBlock;
using llmhal_cpu::vf;
using llmhal_cpu::W;
using llmhal_cpu::widen_rows;

enum WeightType : int32_t { kF32 = 0, kBF16 = 1, kI8 = 2 };
enum Scoring : int32_t { kGiven = -1, kSoftmax = 0, kSigmoid = 1 };

constexpr int kBlock = kRowBlock;
// Below this many weight elements in an expert's gate/up projection a call runs on one thread.
constexpr int64_t kMinParallel = 1 << 15;
// From this many weights in an expert's down projection an expert is large (Mixtral's: h 1024,
// inter 2816), for the widened path's prefetch rule (expert_block_widened).
constexpr int64_t kLargeExpert = 1 << 20;
// Expert blocks of bf16 rows on the bf16 dots prefetch their weight rows kPrefetchAhead bytes
// ahead into L2 (prefetcht2) from kPrefetchRows tokens. With 3 or more tokens the dots take long
// enough that the hardware prefetcher alone leaves the memory idle between them: one thread on a
// Mixtral-shaped layer streamed 11-12 GB/s at 8 tokens an expert without, 18-20 with (a plain loop
// over 184 MB); a whole layer at 8 tokens (7.1 experts touched, 1-8 tokens each) ran 1.03-1.08x
// faster in each of 10 interleaved runs (docs/moe.md). Below that the prefetch instructions cost
// more than they hide: prefetching blocks of 1-2 tokens too read a Mixtral-shaped layer at one
// token at 0.78-0.80x of a plain two-stream read, against 0.88-0.96x without. Small experts
// (DeepSeek-V2-Lite's 384 x 512) follow the same rule: prefetching every block, which an earlier
// host had favoured, read 208 cold DeepSeek-shaped layers (top-4 of 16) at 0.73-0.77x of that
// read at 1-8 tokens, the rule 0.82-0.92x (docs/moe.md).
constexpr int kPrefetchRows = 3;
constexpr int64_t kPrefetchAhead = 8192;
#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dots = true;  // expert_block_bf16 is built
#else
constexpr bool kHaveBf16Dots = false;
#endif

struct Layer {
  const float* x;  // [t, h] float32 (widened by llmhal_moe_call; empty on the bf16 dots)
  const void* w13;
  const void* w2;
  const float* s13;  // [e, 2i] int8 scales or null
  const float* s2;   // [e, h]
  float* out;        // [t, h]
  int64_t h, inter;
  int threads;
  // The bfloat16 activations as given ([t, h], row stride x16_s), or null: with bf16 weights the
  // experts then run on AVX512-BF16 dots (expert_block_bf16).
  const uint16_t* x16;
  int64_t x16_s;
};

// The gate/up half of an expert for n tokens, shared by both forms below: W gate rows and their
// W up rows at a time (pair(r, g, u) writes the n tokens' gate and up dots of intermediate row r),
// so silu(gate) * up runs on whole vectors (exp_approx: about 1 ulp); put(j, r0, lanes, a) stores
// token j's lanes from row r0. A work-sharing loop of the caller's team (ends in a barrier).
template <typename Pair, typename Put>
void gate_up(int64_t inter, int n, Pair pair, Put put) {
  const int64_t groups = (inter + W - 1) / W;
#pragma omp for schedule(static)
  for (int64_t grp = 0; grp < groups; ++grp) {
    const int64_t r0 = grp * W, lanes = std::min<int64_t>(W, inter - r0);
    vf gate[kBlock] = {}, up[kBlock] = {};
    for (int64_t l = 0; l < lanes; ++l) {
      float g[kBlock], u[kBlock];
      pair(r0 + l, g, u);
      for (int j = 0; j < n; ++j) {
        gate[j][l] = g[j];
        up[j][l] = u[j];
      }
    }
    for (int j = 0; j < n; ++j) put(j, r0, lanes, gate[j] / (1.f + exp_approx(-gate[j])) * up[j]);
  }
}

// One expert's block of n tokens: rows[j] is the token, wts[j] its routing weight.
// act: [kBlock, inter] scratch for silu(gate) * up. Called by every thread of run()'s team: the
// loops over weight rows are shared among them (and end in barriers).
template <typename T>
void expert_block_widened(const Layer& L, int64_t e, const int64_t* rows, const float* wts, int n,
                          float* act) {
  const int64_t h = L.h, inter = L.inter, two_i = 2 * inter;
  const T* w13 = static_cast<const T*>(L.w13) + e * two_i * h;
  const T* w2 = static_cast<const T*>(L.w2) + e * h * inter;
  const float* s13 = L.s13 ? L.s13 + e * two_i : nullptr;
  const float* s2 = L.s2 ? L.s2 + e * h : nullptr;
  const float* xs[kBlock];
  const float* as[kBlock];
  for (int j = 0; j < n; ++j) {
    xs[j] = L.x + rows[j] * h;
    as[j] = act + j * inter;
  }
  // Large experts prefetch their rows into L2 here at any token count: these rows are widened in
  // registers, which keeps even one token's dots busy enough to leave memory idle (measured on
  // int8 experts with bf16 activations, before they moved to the bf16 dots: Mixtral-shaped, 16
  // cold layers, 1.18-1.34x at 8 tokens, 0.98-1.01x at one; DeepSeek-shaped small ones
  // 0.95-1.10x, so not them).
  const int64_t ahead = h * inter >= kLargeExpert ? kPrefetchAhead : 0;
  gate_up(inter, n,
          [&](int64_t r, float* g, float* u) {
            dots(w13 + r * h, xs, n, h, g, ahead);
            dots(w13 + (inter + r) * h, xs, n, h, u, ahead);
            const float sg = s13 ? s13[r] : 1.f, su = s13 ? s13[inter + r] : 1.f;
            for (int j = 0; j < n; ++j) {
              g[j] *= sg;
              u[j] *= su;
            }
          },
          [&](int j, int64_t r0, int64_t lanes, vf a) {
            std::memcpy(act + j * inter + r0, &a, sizeof(float) * lanes);
          });
#pragma omp for schedule(static)
  for (int64_t r = 0; r < h; ++r) {
    float d[kBlock];
    dots(w2 + r * inter, as, n, inter, d, ahead);
    const float s = s2 ? s2[r] : 1.f;
    for (int j = 0; j < n; ++j) L.out[rows[j] * h + r] += d[j] * s * wts[j];
  }
}

#if defined(__AVX512BF16__)
// The same for bfloat16 weights and activations on AVX512-BF16 dots (dot_rows.h): a gate row and
// its up row in one pass, and silu(gate) * up rounded to bf16 (as torch's bf16 path rounds it) so
// the down rows run on the same dots, two at a time. (Reducing 16 rows' partial sums together, as
// rows_linear once did, made this 40% slower: 6.8-9.1 ms against 4.8-5.0 on a Mixtral-shaped
// layer.) Widening both sides instead made the kernel compute-bound at 2 or more tokens an
// expert (a Mixtral-shaped expert at 8 tokens: 3.8 ms of which the widened down projection took
// twice the gate/up's time).
// int8 weights (experts_int8) with bf16 activations run here too, converted to bf16 in registers
// (exactly) and their row scales applied to the sums: half the bytes of bf16 and a dot
// instruction per 32 weights, where the widened path spent a conversion and a float32 FMA per
// 16. A Mixtral-shaped int8 layer (16 cold layers alternated with the widened path) ran 1.40x
// faster at 8 tokens, 1.29x at 4 and 1.11x at 1; DeepSeek-shaped 1.36x at 8, 1.02x at 1.
// act16: [kBlock, inter] bf16 scratch.
template <typename Wt>
void expert_block_bf16(const Layer& L, int64_t e, const int64_t* rows, const float* wts, int n,
                       uint16_t* act16) {
  const int64_t h = L.h, inter = L.inter;
  const Wt* w13 = static_cast<const Wt*>(L.w13) + e * 2 * inter * h;
  const Wt* w2 = static_cast<const Wt*>(L.w2) + e * h * inter;
  const float* s13 = L.s13 ? L.s13 + e * 2 * inter : nullptr;
  const float* s2 = L.s2 ? L.s2 + e * h : nullptr;
  const uint16_t* xs[kBlock];
  const uint16_t* as[kBlock];
  for (int j = 0; j < n; ++j) {
    xs[j] = L.x16 + rows[j] * L.x16_s;
    as[j] = act16 + j * inter;
  }
  // int8 rows (half the bytes, and a conversion per load) prefetch at any token count: 1.00-1.04x
  // against the bf16 rule at 1, 2 and 8 tokens.
  const bool int8 = std::is_same_v<Wt, int8_t>;
  const int64_t ahead = int8 || n >= kPrefetchRows ? kPrefetchAhead : 0;
  gate_up(inter, n,
          [&](int64_t r, float* g, float* u) {
            dots2_bf16<_MM_HINT_T2>(w13 + r * h, w13 + (inter + r) * h, xs, n, h, g, u, ahead);
            if (s13) {
              for (int j = 0; j < n; ++j) {
                g[j] *= s13[r];
                u[j] *= s13[inter + r];
              }
            }
          },
          [&](int j, int64_t r0, int64_t lanes, vf a) {
            for (int64_t l = 0; l < lanes; ++l) act16[j * inter + r0 + l] = f32_to_bf16_bits(a[l]);
          });
  // The two down rows of a pass are r and r + half, two weight streams half the projection apart
  // like the gate/up pass's (rows r and r + 1 were one stream: a Mixtral-shaped layer at 8 tokens,
  // one thread, read its experts at 16-20 GB/s, now 19-23; the same sums, bit for bit).
  const int64_t half = (h + 1) / 2;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < half; ++r) {
    const int64_t r1 = r + half;
    const bool two = r1 < h;
    float d0[kBlock], d1[kBlock];
    dots2_bf16<_MM_HINT_T2>(w2 + r * inter, w2 + (two ? r1 : r) * inter, as, n, inter, d0, d1,
                            ahead);
    if (s2) {
      for (int j = 0; j < n; ++j) {
        d0[j] *= s2[r];
        d1[j] *= s2[two ? r1 : r];
      }
    }
    for (int j = 0; j < n; ++j) {
      L.out[rows[j] * h + r] += d0[j] * wts[j];
      if (two) L.out[rows[j] * h + r1] += d1[j] * wts[j];
    }
  }
}
#endif

template <typename T>
void run(const Layer& L, const int64_t* ids, const float* weights, int64_t t, int64_t k,
         int64_t experts) {
  // Counting sort of the (token, choice) pairs by expert; within an expert, token order.
  std::vector<int64_t> start(experts + 1, 0), rows(t * k);
  std::vector<float> wts(t * k);
  for (int64_t p = 0; p < t * k; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < t * k; ++p) {
    const int64_t slot = fill[ids[p]]++;
    rows[slot] = p / k;
    wts[slot] = weights[p];
  }
  // Scratch for silu(gate) * up: bf16 on the bf16 dots (which every block takes when L.x16 is
  // set), float32 on the widened path.
  std::vector<float> act(L.x16 ? 0 : kBlock * L.inter);
  std::vector<uint16_t> act16(L.x16 ? kBlock * L.inter : 0);
  std::memset(L.out, 0, sizeof(float) * t * L.h);
  // One team for the whole layer (waking a team per expert cost more than a small expert's
  // product); serial when the projections are small.
  const bool par = L.threads > 1 && 2 * L.inter * L.h >= kMinParallel;
#pragma omp parallel num_threads(L.threads) if (par)
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t b = start[e]; b < start[e + 1]; b += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, start[e + 1] - b));
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, uint16_t> || std::is_same_v<T, int8_t>) {
        if (L.x16) {
          expert_block_bf16<T>(L, e, rows.data() + b, wts.data() + b, n, act16.data());
          continue;
        }
      }
#endif
      expert_block_widened<T>(L, e, rows.data() + b, wts.data() + b, n, act.data());
    }
  }
}

// ---- Routing: select_experts (llmhal/ops/fused_moe.py) for one token, in float32 --------------

using Entry = std::pair<double, int64_t>;  // ATen's topk queue: (value as its accscalar, index)

// NaN sorts above every number (numpy's order), as in torch.topk.
inline bool above(const Entry& a, const Entry& b) {
  return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
}

// The k largest of v[0..n) as torch.topk(largest=True, sorted=True) returns them on the CPU, ties
// included: ATen's kernel (TopKImpl.h) fills (value, index) pairs in index order, then runs
// std::partial_sort when k * 64 <= n, else std::nth_element and std::sort of the first k - 1.
// Neither is stable, so which of two equal values comes first is whatever those algorithms do:
// running the same libstdc++ algorithms on the same queue gives the same order (checked against
// torch.topk on tie-heavy inputs by the tests).
void topk_like_torch(const float* v, int64_t n, int64_t k, std::vector<Entry>& q, int64_t* ids,
                     float* values) {
  q.resize(n);
  for (int64_t j = 0; j < n; ++j) q[j] = Entry(v[j], j);
  if (k * 64 <= n) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), above);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), above);
    std::sort(q.begin(), q.begin() + k - 1, above);
  }
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = q[j].second;
    if (values) values[j] = static_cast<float>(q[j].first);
  }
}

struct Routing {
  int32_t scoring, renormalize, groups, topk_group;
  const float* bias;  // e_score_correction_bias [experts] or null
  float scale;        // routed_scaling_factor
};

// One token's expert ids and weights from its router logits (float32 [experts]): torch's
// select_experts step by step, so the same experts are chosen in the same order. The scores'
// exp is std::exp (torch's vectorised exp may differ in the last bit; the weights then differ by
// an ulp, the choice only at an exact tie the rounding created).
void route_token(const float* logits, int64_t experts, int64_t k, const Routing& r,
                 std::vector<float>& scores, std::vector<float>& choice,
                 std::vector<Entry>& q, int64_t* ids, float* weights) {
  scores.resize(experts);
  if (r.scoring == kSoftmax) {
    float m = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) m = std::max(m, logits[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < experts; ++e) sum += (scores[e] = std::exp(logits[e] - m));
    const float inv = 1.f / sum;  // ATen's softmax multiplies by the reciprocal of the sum
    for (int64_t e = 0; e < experts; ++e) scores[e] *= inv;
  } else {
    for (int64_t e = 0; e < experts; ++e) scores[e] = 1.f / (1.f + std::exp(-logits[e]));
  }
  const float* pick = scores.data();
  if (r.bias || r.groups > 1) {
    choice.resize(experts);
    for (int64_t e = 0; e < experts; ++e) choice[e] = scores[e] + (r.bias ? r.bias[e] : 0.f);
    if (r.groups > 1) {
      const int64_t per = experts / r.groups;
      float group_score[256];  // groups <= 256 (checked by the caller)
      float top2[2];
      int64_t top2_ids[2];
      std::vector<Entry> gq;
      for (int64_t g = 0; g < r.groups; ++g) {
        const float* c = choice.data() + g * per;
        if (r.bias) {  // the sum of the group's best two, summed in topk's order
          topk_like_torch(c, per, 2, gq, top2_ids, top2);
          group_score[g] = top2[0] + top2[1];
        } else {
          float m = c[0];
          for (int64_t e = 1; e < per; ++e) m = (std::isnan(c[e]) || c[e] > m) ? c[e] : m;
          group_score[g] = m;
        }
      }
      int64_t kept[256];
      topk_like_torch(group_score, r.groups, r.topk_group, gq, kept, nullptr);
      bool keep[256] = {};
      for (int64_t j = 0; j < r.topk_group; ++j) keep[kept[j]] = true;
      for (int64_t e = 0; e < experts; ++e) {
        if (!keep[e / per]) choice[e] = -1e30f;
      }
    }
    pick = choice.data();
  }
  topk_like_torch(pick, experts, k, q, ids, nullptr);
  float sum = 0.f;
  for (int64_t j = 0; j < k; ++j) sum += (weights[j] = scores[ids[j]]);
  for (int64_t j = 0; j < k; ++j) {
    if (r.renormalize) weights[j] = weights[j] / (sum + 1e-20f);
    if (r.scale != 1.f) weights[j] = weights[j] * r.scale;
  }
}

}  // namespace

extern "C" {

// One MoE layer for a few tokens (the struct form that llmhal_cpu/step_graph.py records; it
// mirrors MoeArgs in moe_experts.py). x: [t, h] rows of stride x_s, float32 or (x_bf16)
// bfloat16. Routing: when scoring is kSoftmax or kSigmoid, from logits ([t, experts] rows of
// stride logits_s, float32 or (logits_bf16) bf16) into ids/weights [t, k] (int64 / float32,
// contiguous); with kGiven, ids/weights are read. Then, when out is set, the experts: w13
// [experts, 2 * inter, h] and w2 [experts, h, inter] of wtype (s13/s2 the int8 row scales),
// out [t, h] contiguous, float32 or (out_bf16) bf16 rounded once. Returns 0, or -1 for an expert
// id out of range, an unknown type or an unusable grouping (nothing is written to out).
struct MoeArgs {
  const void* x;
  int64_t x_s;
  const void* logits;
  int64_t logits_s;
  const float* bias;
  int64_t* ids;
  float* weights;
  const void* w13;
  const void* w2;
  const float* s13;
  const float* s2;
  void* out;
  // Added to out before its rounding: shared [t, h] (rows of stride shared_s, in x's dtype), times
  // sigmoid(shared_gate[i * gate_s]) (in x's dtype) when that is set; null: nothing added.
  const void* shared;
  int64_t shared_s;
  const void* shared_gate;
  int64_t gate_s;
  int64_t t, experts, h, inter, k;
  float scale;
  int32_t x_bf16, logits_bf16, out_bf16, wtype, scoring, renormalize, groups, topk_group, threads;
};

int llmhal_moe_call(const void* p) {
  const auto& a = *static_cast<const MoeArgs*>(p);
  const int64_t t = a.t, k = a.k, experts = a.experts;
  if (k < 1 || k > experts || a.wtype < kF32 || a.wtype > kI8) return -1;
  if (a.scoring != kGiven) {
    if (a.groups > 1 && (a.groups > 256 || experts % a.groups || a.topk_group < 1 ||
                         a.topk_group > a.groups || (a.bias && experts / a.groups < 2)))
      return -1;
    const Routing r{a.scoring, a.renormalize, a.groups, a.topk_group, a.bias, a.scale};
    std::vector<float> logits(experts), scores, choice;
    std::vector<Entry> q;
    for (int64_t i = 0; i < t; ++i) {
      widen_rows(static_cast<const char*>(a.logits) +
                     i * a.logits_s * (a.logits_bf16 ? sizeof(uint16_t) : sizeof(float)),
                 0, a.logits_bf16, 1, experts, logits.data());
      route_token(logits.data(), experts, k, r, scores, choice, q, a.ids + i * k,
                  a.weights + i * k);
    }
  }
  if (!a.out) return 0;
  for (int64_t p2 = 0; p2 < t * k; ++p2) {
    if (a.ids[p2] < 0 || a.ids[p2] >= experts) return -1;
  }
  // bf16 and int8 experts with bf16 activations run on the bf16 dots (int8: see
  // expert_block_bf16). bf16 ones: on Mixtral-shaped experts (h 1024, inter 2816; 8 tokens)
  // 4.7-5.0 ms a layer against 6.8 widened. On DeepSeek-V2-Lite-like small ones (h 512, inter
  // 384) they lost (0.75-0.95 against 0.7-0.8 ms) until they prefetched: then 1.6-1.9x faster
  // than the widened path in interleaved runs (5 cold layers, 8 tokens). They read the bf16
  // activations as given, so only the widened path needs them as float32.
  const bool bf16_dots = kHaveBf16Dots && a.x_bf16 && (a.wtype == kBF16 || a.wtype == kI8);
  std::vector<float> x(bf16_dots ? 0 : t * a.h);
  if (!bf16_dots) widen_rows(a.x, a.x_s, a.x_bf16, t, a.h, x.data());
  std::vector<float> acc;
  float* out = static_cast<float*>(a.out);
  if (a.out_bf16) {
    acc.resize(t * a.h);
    out = acc.data();
  }
  const Layer L{x.data(), a.w13, a.w2, a.s13, a.s2, out, a.h, a.inter, a.threads,
                bf16_dots ? static_cast<const uint16_t*>(a.x) : nullptr, a.x_s};
  switch (a.wtype) {
    case kF32: run<float>(L, a.ids, a.weights, t, k, experts); break;
    case kBF16: run<uint16_t>(L, a.ids, a.weights, t, k, experts); break;
    default: run<int8_t>(L, a.ids, a.weights, t, k, experts); break;
  }
  if (a.shared) {  // the shared experts, added in float32 (one rounding of the sum)
    std::vector<float> row(a.h);
    for (int64_t i = 0; i < t; ++i) {
      widen_rows(static_cast<const char*>(a.shared) + i * a.shared_s * (a.x_bf16 ? 2 : 4), 0,
                 a.x_bf16, 1, a.h, row.data());
      float g = 1.f;
      if (a.shared_gate) {
        widen_rows(static_cast<const char*>(a.shared_gate) + i * a.gate_s * (a.x_bf16 ? 2 : 4), 0,
                   a.x_bf16, 1, 1, &g);
        g = 1.f / (1.f + std::exp(-g));
      }
      for (int64_t c = 0; c < a.h; ++c) out[i * a.h + c] += row[c] * g;
    }
  }
  if (a.out_bf16) {
    auto* o = static_cast<uint16_t*>(a.out);
    for (int64_t j = 0; j < t * a.h; ++j) o[j] = f32_to_bf16_bits(acc[j]);
  }
  return 0;
}

int64_t llmhal_moe_args_size() { return sizeof(MoeArgs); }

}  // extern "C"
