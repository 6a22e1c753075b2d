// Fused MLR attention for CPU: forward and backward, flash-style, in O(T * tile) memory, and one
// decoding step against the compressed cache (decode_kernel, at the end).
//
// Contract (checked and prepared by structured_attention/ops/mlr/cpu.py):
//   q (B, H, T, R), k (B, Hk, T, R), v (B, Hk, T, Dv): any strides with a contiguous last dim (views
//   of a projection's output are read in place; query head h reads key head h / (H / Hk));
//   order: the head dims in the order the levels take them (empty: as they come); scale: the
//   scores' factor; sizes: block size per level (s_1 >= T, nested); offsets: R_d = r_1 + ... + r_d,
//   d = 0..L; segments: (S, 3) int64 (row b * H + h, start, length), or empty for whole rows. Each
//   segment (a packed document, per head) is scored as a sequence of its own: local positions, its
//   own blocks. Outputs are (B, H, T, *) views of (B, T, H, *) memory, the layout a model's output
//   projection reads.
// Score of pair (i, j) at depth d(i, j) = #{l : i / s_l == j / s_l}:
//   S(i, j) = <q_i[:R_d], k_j[:R_d]>  (divided by d if depth_normalize), masked to j <= i if causal.
//
// Each query tile of BQ rows walks its keys in pieces of at most BK columns, cut at the tile's
// block boundaries so that almost every piece has one depth d for all its pairs: its score is then
// ONE matmul over the prefix R_d of the head dims (the reason MLR needs fewer FLOPs). Pieces that
// straddle finer blocks (near the diagonal) add the finer levels' products where the blocks match.
// The softmax is online (running max and sum per row); the backward recomputes each piece's
// probabilities from the saved log-sum-exp and works on transposed pieces (keys x queries) so that
// every product is a row-major matmul over contiguous memory.
//
// Matmuls of float use oneDNN's batch-reduce GEMM (at::native::cpublas::brgemm), the ukernel
// PyTorch's own CPU flash attention uses; double (for tests) uses plain loops.

// The headers this file uses, not <torch/extension.h> (all of ATen and the C++ frontend): parsing
// those was half of the first-use build.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

// C (M x N, ldc) = A (M x K, lda) @ B (K x N, ldb), all row-major; accumulate into C if add.
void matmul(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
            int64_t ldc, bool add) {
  if (K == 0) {
    if (!add)
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.f);
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, false);
}

void matmul(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B, int64_t ldb, double* C,
            int64_t ldc, bool add) {
  for (int64_t i = 0; i < M; ++i) {
    double* c = C + i * ldc;
    if (!add) std::fill(c, c + N, 0.0);
    for (int64_t p = 0; p < K; ++p) {
      const double a = A[i * lda + p];
      const double* b = B + p * ldb;
      for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

void release_matmul(float*) { at::native::cpublas::brgemm_release(false); }
void release_matmul(double*) {}

// y[i] = exp(x[i] - sub) for float (vectorised) and double; returns the sum.
float exp_shift_sum(float* x, int64_t n, float sub) {
  const Vec vsub(sub);
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec e = (Vec::loadu(x + i) - vsub).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - sub);
    sum += x[i];
  }
  return sum;
}

double exp_shift_sum(double* x, int64_t n, double sub) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - sub);
    sum += x[i];
  }
  return sum;
}

// y[i] = exp(x[i] - sub[i]) elementwise (a row of a transposed piece against per-query lse).
void exp_minus(float* x, const float* sub, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(x + i) - Vec::loadu(sub + i)).exp_u20().store(x + i);
  for (; i < n; ++i) x[i] = std::exp(x[i] - sub[i]);
}

void exp_minus(double* x, const double* sub, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - sub[i]);
}

template <typename T>
T row_max(const T* x, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

template <>
float row_max<float>(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= Vec::size()) {
    Vec acc = Vec::loadu(x);
    for (i = Vec::size(); i + Vec::size() <= n; i += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(x + i));
    m = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, acc);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// <x, y> over n values (vector lanes summed at the end for float).
template <typename T>
T dot(const T* x, const T* y, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}

template <>
float dot<float>(const float* x, const float* y, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(x + i), Vec::loadu(y + i), acc);
  float s = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}

// The nested block structure and the per-level prefix widths.
struct Levels {
  std::vector<int64_t> sizes;    // s_l, level 0 first
  std::vector<int64_t> offsets;  // R_d for d = 0..L
  int64_t L() const { return static_cast<int64_t>(sizes.size()); }

  // Number of levels whose block holds both i and j.
  int64_t depth(int64_t i, int64_t j) const {
    int64_t d = 0;
    for (int64_t s : sizes) {
      if (i / s != j / s) break;
      ++d;
    }
    return d;
  }

  // For rows [i0, i1) x cols [j0, j1): every pair has depth >= dmin, none has depth > dmax.
  void depth_range(int64_t i0, int64_t i1, int64_t j0, int64_t j1, int64_t* dmin, int64_t* dmax) const {
    *dmin = 0;
    *dmax = 0;
    for (int64_t l = 0; l < L(); ++l) {
      const int64_t s = sizes[l];
      const int64_t rb0 = i0 / s, rb1 = (i1 - 1) / s, cb0 = j0 / s, cb1 = (j1 - 1) / s;
      if (rb0 == rb1 && cb0 == cb1 && rb0 == cb0) {
        *dmin = *dmax = l + 1;
      } else if (!(rb1 < cb0 || cb1 < rb0)) {
        *dmax = l + 1;
      }
    }
  }
};

// Key pieces [j0, j1) of query tile [i0, i1): cut at the tile's block boundaries, at most bk wide.
// A level whose block holds the whole tile cuts at that block's ends, so the pieces between have
// one depth for all their pairs. From the first level whose blocks the tile straddles, the keys
// from the start of the tile's first such block on form one region: cutting it at every finer
// boundary would leave pieces a few keys wide (each a pass of the online softmax); instead its
// pieces add the finer levels' products where blocks are shared (piece_scores).
std::vector<std::pair<int64_t, int64_t>> key_pieces(const Levels& lv, int64_t i0, int64_t i1, int64_t end,
                                                    int64_t bk) {
  std::vector<int64_t> cuts = {0, end};
  for (int64_t s : lv.sizes) {
    const int64_t b = (i0 / s) * s;
    const bool straddles = (i1 - 1) / s != i0 / s;
    for (int64_t c : {b, b + s})
      if (c > 0 && c < end && (c == b || !straddles)) cuts.push_back(c);
    if (straddles) break;
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    const int64_t a = cuts[c], b = cuts[c + 1];
    const int64_t n = (b - a + bk - 1) / bk;
    const int64_t w = (b - a + n - 1) / n;  // equal widths
    for (int64_t x = a; x < b; x += w) pieces.emplace_back(x, std::min(x + w, b));
  }
  return pieces;
}

// Calls fn(a0, a1, b0, b1) for each level block of size s meeting both [i0, i1) and [j0, j1): the
// sub-rectangle [a0, a1) x [b0, b1) of pairs that share that block.
template <typename Fn>
void for_each_shared_block(int64_t s, int64_t i0, int64_t i1, int64_t j0, int64_t j1, Fn fn) {
  for (int64_t b = (std::max(i0, j0) / s) * s; b < std::min(i1, j1); b += s) {
    const int64_t a0 = std::max(i0, b), a1 = std::min(i1, b + s), b0 = std::max(j0, b), b1 = std::min(j1, b + s);
    if (a0 < a1 && b0 < b1) fn(a0, a1, b0, b1);
  }
}

// Depth of every pair of the piece rows [i0, i0 + m) x cols [j0, j0 + n) into D (m x n).
template <typename scalar_t>
void piece_depths(const Levels& lv, int64_t dmin, int64_t dmax, int64_t i0, int64_t m, int64_t j0, int64_t n,
                  scalar_t* D) {
  std::fill(D, D + m * n, scalar_t(dmin));
  for (int64_t l = dmin; l < dmax; ++l)
    for_each_shared_block(lv.sizes[l], i0, i0 + m, j0, j0 + n, [&](int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
      for (int64_t a = a0; a < a1; ++a)
        for (int64_t b = b0; b < b1; ++b) D[(a - i0) * n + (b - j0)] += scalar_t(1);
    });
}

// Scores of rows [i0, i0 + m) x cols [j0, j0 + n) into S (m x n, row-major), "transposed" when
// rows index keys and cols queries. A: row i0 of the row side (rows of lda, dims in level order);
// Bt: column j0 of the column side transposed (leading dimension ldb). The prefix R_dmin is one
// matmul; each finer level that only some pairs share adds its product on the sub-rectangles of
// its shared blocks. Then 1/depth (depth_normalize; D is scratch) and -inf where the pair is in
// the causal future.
template <typename scalar_t>
void piece_scores(const Levels& lv, int64_t dmin, int64_t dmax, int64_t i0, int64_t m, int64_t j0, int64_t n,
                  bool rows_are_keys, const scalar_t* A, int64_t lda, const scalar_t* Bt, int64_t ldb, bool causal,
                  bool depth_normalize, scalar_t* S, scalar_t* D) {
  matmul(m, n, lv.offsets[dmin], A, lda, Bt, ldb, S, n, false);
  for (int64_t l = dmin; l < dmax; ++l) {
    const int64_t o0 = lv.offsets[l], o1 = lv.offsets[l + 1];
    for_each_shared_block(lv.sizes[l], i0, i0 + m, j0, j0 + n, [&](int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
      matmul(a1 - a0, b1 - b0, o1 - o0, A + (a0 - i0) * lda + o0, lda, Bt + o0 * ldb + (b0 - j0), ldb,
             S + (a0 - i0) * n + (b0 - j0), n, true);
    });
  }
  if (depth_normalize) {
    if (dmin == dmax) {
      if (dmin > 1) {
        const scalar_t f = scalar_t(1) / scalar_t(dmin);
        for (int64_t x = 0; x < m * n; ++x) S[x] *= f;
      }
    } else {
      piece_depths(lv, dmin, dmax, i0, m, j0, n, D);
      for (int64_t x = 0; x < m * n; ++x) S[x] /= D[x];
    }
  }
  if (causal) {  // query index > key index is allowed; mask key > query: a run of each row
    const scalar_t ninf = -std::numeric_limits<scalar_t>::infinity();
    for (int64_t a = 0; a < m; ++a) {
      const int64_t r = i0 + a - j0;  // the row's own position among the columns
      scalar_t* row = S + a * n;
      if (rows_are_keys)  // a key row: the queries before it
        std::fill(row, row + std::clamp<int64_t>(r, 0, n), ninf);
      else  // a query row: the keys after it
        std::fill(row + std::clamp<int64_t>(r + 1, 0, n), row + n, ninf);
    }
  }
}

// A run of positions [start, start + len) of row n = b * H + h (one head of one sequence or packed
// document): positions and blocks count from its start and it attends only within itself.
struct Segment {
  int64_t n, start, len;
};

// The segments of (N, T) rows: from a (S, 3) int64 tensor of (row, start, length), or every row
// whole when it is empty.
std::vector<Segment> make_segments(const at::Tensor& segments, int64_t N, int64_t T) {
  std::vector<Segment> out;
  if (segments.numel() == 0) {
    for (int64_t n = 0; n < N; ++n) out.push_back({n, 0, T});
    return out;
  }
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.is_contiguous(),
              "mlr_cpu: segments must be a contiguous (S, 3) int64 tensor of (row, start, length)");
  const int64_t* p = segments.data_ptr<int64_t>();
  for (int64_t x = 0; x < segments.size(0); ++x) {
    const Segment g{p[3 * x], p[3 * x + 1], p[3 * x + 2]};
    TORCH_CHECK(g.n >= 0 && g.n < N && g.start >= 0 && g.len > 0 && g.start + g.len <= T,
                "mlr_cpu: a segment outside the rows");
    out.push_back(g);
  }
  return out;
}

// A (B, H, T, D) tensor with a contiguous last dim, read or written in place: row (b, h, t).
template <typename T>
struct Rows {
  T* p;
  int64_t sb, sh, st;
  T* row(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& x) {
  return {x.data_ptr<std::remove_const_t<T>>(), x.stride(0), x.stride(1), x.stride(2)};
}

// dst[i] = src[i] * f for a short run (a block's row, a head's row): whole vectors for float, not
// scalar moves (what the compiler made of a fixed-length loop, a quarter of the backward's own
// time) nor a call to memmove per row.
template <typename T>
void scaled_copy(const T* src, int64_t n, T f, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * f;
}

template <>
void scaled_copy<float>(const float* src, int64_t n, float f, float* dst) {
  int64_t i = 0;
  if (f == 1.f)
    for (; i + Vec::size() <= n; i += Vec::size()) Vec::loadu(src + i).store(dst + i);
  else
    for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(src + i) * Vec(f)).store(dst + i);
  for (; i < n; ++i) dst[i] = src[i] * f;
}

// dst (n x D, row-major) = rows [t0, t0 + n) of head (b, h), as they are.
template <typename T>
void copy_rows(const Rows<const T>& x, int64_t b, int64_t h, int64_t t0, int64_t n, int64_t D, T* dst) {
  for (int64_t a = 0; a < n; ++a) scaled_copy(x.row(b, h, t0 + a), D, T(1), dst + a * D);
}

// dst[j][i] = src[i][j] * f for i < M, j < N, rows given by pointers (so that either side's rows
// can be permuted or strided): 16 x 16 blocks through two small buffers, transposed in registers
// for float. A dim-at-a-time transpose into rows 4 KB apart (T = 1024) took a fifth of the
// backward: such rows share one set of the L1 cache.
template <typename T, typename SrcRow, typename DstRow>
void transpose_rows(SrcRow src, DstRow dst, int64_t M, int64_t N, T f) {
  constexpr int64_t C = 16;
  T in[C * C], out[C * C];
  for (int64_t i0 = 0; i0 < M; i0 += C) {
    const int64_t m = std::min(C, M - i0);
    // The next block's rows, ahead: rows far apart (a projection's output, H * D apart) defeat the
    // hardware's prefetcher, and these rows are read once, from memory.
    for (int64_t i = i0 + C; i < std::min(M, i0 + 2 * C); ++i)
      for (int64_t c = 0; c < N; c += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(src(i) + c);
    for (int64_t j0 = 0; j0 < N; j0 += C) {
      const int64_t n = std::min(C, N - j0);
      for (int64_t i = 0; i < m; ++i) scaled_copy(src(i0 + i) + j0, n, T(1), in + i * C);
      at::vec::transpose_mxn<T>(in, C, out, C, static_cast<int>(m), static_cast<int>(n));
      for (int64_t j = 0; j < n; ++j) scaled_copy(out + j * C, m, f, dst(j0 + j) + i0);
    }
  }
}

// The leading dimension of a transposed (dims x n) buffer: one cache line past n, so that its
// rows (read a few at a time by the matmuls) do not fall into one cache set when n * 4 bytes is a
// multiple of 4 KB.
int64_t padded(int64_t n) { return n + 16; }

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = i;
  return x;
}

// The head dims' order as the packing uses it: pos[d] is the position of input dim d in the
// levels' order; identity when they are the same.
struct DimOrder {
  std::vector<int64_t> pos;
  bool identity;
};

// dst (D x n, leading dimension ld) = rows [t0, t0 + n) of head (b, h) transposed, times f, dims
// in the levels' order.
template <typename T>
void pack_transposed(const Rows<const T>& x, int64_t b, int64_t h, int64_t t0, int64_t n, const DimOrder& dims,
                     T f, T* dst, int64_t ld) {
  transpose_rows([&](int64_t i) { return x.row(b, h, t0 + i); }, [&](int64_t d) { return dst + dims.pos[d] * ld; },
                 n, static_cast<int64_t>(dims.pos.size()), f);
}

// dst[d] = src[pos[d]] for one row (a row in the levels' dims order back to the input's).
template <typename T>
void permuted_copy(const T* src, const DimOrder& dims, T* dst) {
  const int64_t R = static_cast<int64_t>(dims.pos.size());
  if (dims.identity) return scaled_copy(src, R, T(1), dst);
  const int64_t* pos = dims.pos.data();
  for (int64_t d = 0; d < R; ++d) dst[d] = src[pos[d]];
}

// dst (n x D, row-major) = src (D x n, leading dimension ld) transposed, times f.
template <typename T>
void untranspose(const T* src, int64_t ld, int64_t D, int64_t n, T f, T* dst) {
  transpose_rows([&](int64_t c) { return src + c * ld; }, [&](int64_t a) { return dst + a * D; }, D, n, f);
}

template <typename scalar_t>
void forward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                    const std::vector<Segment>& segs, const Levels& lv, const DimOrder& dims, scalar_t scale,
                    bool causal, bool depth_normalize, int64_t bq, int64_t bk) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), R = q.size(3), Hk = k.size(1), G = H / Hk;
  const int64_t Dv = v.size(3);
  const Rows<const scalar_t> qr = rows_of<const scalar_t>(q), kr = rows_of<const scalar_t>(k),
                             vr = rows_of<const scalar_t>(v);
  const Rows<scalar_t> outr = rows_of<scalar_t>(out);
  // Every key head transposed, times the scale, dims in the levels' order, (B * Hk, R, ldT): the
  // score matmuls' right side; and the values contiguous, (B * Hk, T, Dv): rows H * Dv apart, as a
  // projection's output leaves them, fall into a few cache sets.
  const int64_t ldT = padded(T);
  at::Tensor kT = at::empty({B * Hk, R, ldT}, q.options()), vc = at::empty({B * Hk, T, Dv}, q.options());
  scalar_t* kTp = kT.data_ptr<scalar_t>();
  scalar_t* vp = vc.data_ptr<scalar_t>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t x = begin; x < stop; ++x) {
      pack_transposed(kr, x / Hk, x % Hk, 0, T, dims, scale, kTp + x * R * ldT, ldT);
      copy_rows(vr, x / Hk, x % Hk, 0, T, Dv, vp + x * T * Dv);
    }
  });
  // Tasks: the query tiles of every segment, numbered segment by segment.
  std::vector<int64_t> first_task(segs.size() + 1, 0);
  for (size_t x = 0; x < segs.size(); ++x) first_task[x + 1] = first_task[x] + (segs[x].len + bq - 1) / bq;
  scalar_t* lp = lse.data_ptr<scalar_t>();
  // Tasks go to threads cyclically (worker w takes tasks w, w + P, ...): a later tile of a segment
  // has more keys than an earlier one, and segments differ in length, so contiguous ranges of
  // tasks would leave one thread with most of the work.
  const int64_t total = first_task.back();
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  at::parallel_for(0, P, 1, [&](int64_t wbegin, int64_t wend) {
    std::vector<scalar_t> Qt(bq * R), QtT(R * bq), S(bq * bk), D(bq * bk), acc(bq * Dv), mx(bq), sum(bq);
    for (int64_t w = wbegin; w < wend; ++w)
    for (int64_t task = w; task < total; task += P) {
      const size_t x = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const Segment& g = segs[x];
      const int64_t b = g.n / H, h = g.n % H, hk = h / G;
      const int64_t Tl = g.len, i0 = (task - first_task[x]) * bq, i1 = std::min(i0 + bq, Tl), m = i1 - i0;
      // The tile's queries with their dims in the levels' order: read in place when that is theirs.
      const scalar_t* qa = qr.row(b, h, g.start + i0);
      int64_t lda = qr.st;
      if (!dims.identity) {
        pack_transposed(qr, b, h, g.start + i0, m, dims, scalar_t(1), QtT.data(), bq);
        untranspose(QtT.data(), bq, R, m, scalar_t(1), Qt.data());
        qa = Qt.data();
        lda = R;
      }
      const scalar_t* kTh = kTp + (b * Hk + hk) * R * ldT + g.start;
      const scalar_t* vh = vp + ((b * Hk + hk) * T + g.start) * Dv;
      std::fill(acc.begin(), acc.end(), scalar_t(0));
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<scalar_t>::infinity());
      std::fill(sum.begin(), sum.end(), scalar_t(0));
      for (auto [j0, j1] : key_pieces(lv, i0, i1, causal ? i1 : Tl, bk)) {
        const int64_t n = j1 - j0;
        int64_t dmin, dmax;
        lv.depth_range(i0, i1, j0, j1, &dmin, &dmax);
        const bool masked = causal && j1 - 1 > i0;
        piece_scores(lv, dmin, dmax, i0, m, j0, n, false, qa, lda, kTh + j0, ldT, masked, depth_normalize, S.data(),
                     D.data());
        for (int64_t a = 0; a < m; ++a) {  // online softmax: rescale the row, add this piece's exps
          scalar_t* row = S.data() + a * n;
          const scalar_t new_max = std::max(mx[a], row_max(row, n));
          const scalar_t piece_sum = exp_shift_sum(row, n, new_max);
          const scalar_t keep = std::exp(mx[a] - new_max);  // 0 for the row's first piece
          sum[a] = sum[a] * keep + piece_sum;
          mx[a] = new_max;
          if (keep != scalar_t(1))
            for (int64_t d = 0; d < Dv; ++d) acc[a * Dv + d] *= keep;
        }
        matmul(m, Dv, n, S.data(), n, vh + j0 * Dv, Dv, acc.data(), Dv, true);
      }
      for (int64_t a = 0; a < m; ++a) {
        const scalar_t inv = scalar_t(1) / sum[a];
        scalar_t* o = outr.row(b, h, g.start + i0 + a);
        for (int64_t d = 0; d < Dv; ++d) o[d] = acc[a * Dv + d] * inv;
        lp[g.n * T + g.start + i0 + a] = mx[a] + std::log(sum[a]);
      }
    }
    release_matmul(static_cast<scalar_t*>(nullptr));
  });
}

// The gradients per query head: dk and dv are (B, H, T, *), summed over a key head's group by the
// caller. One segment per task: a segment's key gradients receive updates from every query tile of
// it. The task packs what its matmuls read (queries and keys in the levels' order, both ways;
// values and output gradients contiguous, the latter also transposed) and accumulates into its
// own buffers, written out at its end. The scale enters through the keys of the scores and through
// dS (scores s = scale <q, k>: dq = scale dS k, dk = scale dS^T q).
template <typename scalar_t>
void backward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                     const at::Tensor& gout, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                     const std::vector<Segment>& segs, const Levels& lv, const DimOrder& dims, scalar_t scale,
                     bool causal, bool depth_normalize, int64_t bq, int64_t bk) {
  const int64_t H = q.size(1), T = q.size(2), R = q.size(3), G = H / k.size(1), Dv = v.size(3);
  const Rows<const scalar_t> qr = rows_of<const scalar_t>(q), kr = rows_of<const scalar_t>(k),
                             vr = rows_of<const scalar_t>(v), outr = rows_of<const scalar_t>(out),
                             gr = rows_of<const scalar_t>(gout);
  const Rows<scalar_t> dqr = rows_of<scalar_t>(dq), dkr = rows_of<scalar_t>(dk), dvr = rows_of<scalar_t>(dv);
  // Segments cost about length^2: the longest first, dealt to the threads cyclically.
  std::vector<size_t> order_segs(segs.size());
  for (size_t x = 0; x < order_segs.size(); ++x) order_segs[x] = x;
  std::stable_sort(order_segs.begin(), order_segs.end(),
                   [&](size_t a, size_t b) { return segs[a].len > segs[b].len; });
  const int64_t total = static_cast<int64_t>(segs.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  at::parallel_for(0, workers, 1, [&](int64_t wbegin, int64_t wend) {
    std::vector<scalar_t> P(bk * bq), Dp(bk * bq), dS(bk * bq);
    std::vector<scalar_t> Qs, QT, Ks, KT, Vs, Gs, GT, delta, dQT, dK, dV;
    for (int64_t w = wbegin; w < wend; ++w)
    for (int64_t x = w; x < total; x += workers) {
      const Segment& g = segs[order_segs[x]];
      const int64_t b = g.n / H, h = g.n % H, hk = h / G, Tl = g.len, n_tiles = (Tl + bq - 1) / bq;
      const int64_t ld = padded(Tl);  // of the transposed buffers
      for (auto* buf : {&Qs, &Ks, &dK}) buf->resize(Tl * R);
      for (auto* buf : {&QT, &KT, &dQT}) buf->resize(R * ld);
      for (auto* buf : {&Vs, &Gs, &dV}) buf->resize(Tl * Dv);
      GT.resize(Dv * ld);
      std::fill(dQT.begin(), dQT.end(), scalar_t(0));
      std::fill(dK.begin(), dK.end(), scalar_t(0));
      std::fill(dV.begin(), dV.end(), scalar_t(0));
      delta.resize(Tl);
      pack_transposed(qr, b, h, g.start, Tl, dims, scalar_t(1), QT.data(), ld);
      pack_transposed(kr, b, hk, g.start, Tl, dims, scalar_t(1), KT.data(), ld);
      untranspose(QT.data(), ld, R, Tl, scalar_t(1), Qs.data());
      untranspose(KT.data(), ld, R, Tl, scale, Ks.data());
      copy_rows(vr, b, hk, g.start, Tl, Dv, Vs.data());
      copy_rows(gr, b, h, g.start, Tl, Dv, Gs.data());
      transpose_rows([&](int64_t a) { return Gs.data() + a * Dv; }, [&](int64_t d) { return GT.data() + d * ld; }, Tl,
                     Dv, scalar_t(1));
      for (int64_t t = 0; t < Tl; ++t)  // delta = rowsum(dO * O)
        delta[t] = dot(Gs.data() + t * Dv, outr.row(b, h, g.start + t), Dv);
      const scalar_t* lh = lse.data_ptr<scalar_t>() + g.n * T + g.start;
      for (int64_t t = 0; t < n_tiles; ++t) {
        const int64_t i0 = t * bq, i1 = std::min(i0 + bq, Tl), m = i1 - i0;
        for (auto [j0, j1] : key_pieces(lv, i0, i1, causal ? i1 : Tl, bk)) {
          const int64_t n = j1 - j0;
          int64_t dmin, dmax;
          lv.depth_range(i0, i1, j0, j1, &dmin, &dmax);
          const bool masked = causal && j1 - 1 > i0;
          // P^T (keys x queries) = exp(S^T - lse[query])
          piece_scores(lv, dmin, dmax, j0, n, i0, m, true, Ks.data() + j0 * R, R, QT.data() + i0, ld, masked,
                       depth_normalize, P.data(), Dp.data());
          for (int64_t c = 0; c < n; ++c) exp_minus(P.data() + c * m, lh + i0, m);
          // dv[keys] += P^T dO[queries]
          matmul(n, Dv, m, P.data(), m, Gs.data() + i0 * Dv, Dv, dV.data() + j0 * Dv, Dv, true);
          // dS^T = scale P^T * (V[keys] dO^T - delta[query])
          matmul(n, m, Dv, Vs.data() + j0 * Dv, Dv, GT.data() + i0, ld, dS.data(), m, false);
          for (int64_t c = 0; c < n; ++c)
            for (int64_t a = 0; a < m; ++a) dS[c * m + a] = scale * P[c * m + a] * (dS[c * m + a] - delta[i0 + a]);
          if (depth_normalize) {  // the scores were divided by the depth; so is their gradient
            if (dmin == dmax) {
              if (dmin > 1)
                for (int64_t y = 0; y < n * m; ++y) dS[y] /= scalar_t(dmin);
            } else {
              piece_depths(lv, dmin, dmax, j0, n, i0, m, Dp.data());
              for (int64_t y = 0; y < n * m; ++y) dS[y] /= Dp[y];
            }
          }
          // dk[keys, :R_dmin] += dS^T q[queries];  dq^T[:R_dmin, queries] += k^T[:, keys] dS^T
          const int64_t wd = lv.offsets[dmin];
          matmul(n, wd, m, dS.data(), m, Qs.data() + i0 * R, R, dK.data() + j0 * R, R, true);
          matmul(wd, m, n, KT.data() + j0, ld, dS.data(), m, dQT.data() + i0, ld, true);
          for (int64_t l = dmin; l < dmax; ++l) {  // finer levels: only the pairs in a shared block
            const int64_t o0 = lv.offsets[l], o1 = lv.offsets[l + 1];
            for_each_shared_block(lv.sizes[l], j0, j1, i0, i1, [&](int64_t b0, int64_t b1, int64_t a0, int64_t a1) {
              const scalar_t* sub = dS.data() + (b0 - j0) * m + (a0 - i0);  // keys [b0, b1) x queries [a0, a1)
              matmul(b1 - b0, o1 - o0, a1 - a0, sub, m, Qs.data() + a0 * R + o0, R, dK.data() + b0 * R + o0, R, true);
              matmul(o1 - o0, a1 - a0, b1 - b0, KT.data() + o0 * ld + b0, ld, sub, m, dQT.data() + o0 * ld + a0, ld,
                     true);
            });
          }
        }
      }
      // Back to the inputs' rows and dims: dv and dk as they are (dk's dims permuted back), dq from
      // its transpose.
      for (int64_t t = 0; t < Tl; ++t) {
        scaled_copy(dV.data() + t * Dv, Dv, scalar_t(1), dvr.row(b, h, g.start + t));
        permuted_copy(dK.data() + t * R, dims, dkr.row(b, h, g.start + t));
      }
      transpose_rows([&](int64_t d) { return dQT.data() + dims.pos[d] * ld; },
                     [&](int64_t a) { return dqr.row(b, h, g.start + a); }, R, Tl, scalar_t(1));
    }
    release_matmul(static_cast<scalar_t*>(nullptr));
  });
}

// The key loops below fetch the group of eight keys 128 keys ahead of the one they score (4 KiB
// with 8 dims): the hardware's stream prefetcher stops at every 4 KiB page, and a step's key runs
// (level 1's 512 KiB per row and head at a 16k cache, the rings' 4-256 KiB) are short and many, so
// without it the keys streamed at about half the values' rate. The value rows, 256 B each, gain
// nothing from the same. A prefetch past the end of a buffer is dropped, not a fault.
constexpr int64_t kKeysAhead = 128;

template <typename T>
inline void prefetch_keys(const T* k, int64_t st, int64_t j) {
  const T* ahead = k + (j + kKeysAhead) * st;
  for (int64_t c = 0; c < 8 * st; c += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(ahead + c);
}

// s[j] += <q, k_j> for n keys of r dims, k_j at k + j * st. Short rows go eight keys at a time
// (eight independent sums rather than one dependent chain per key); long rows vectorise each dot.
template <typename T>
void add_key_scores(const T* q, const T* k, int64_t st, int64_t r, int64_t n, T* s) {
  int64_t j = 0;
  if (r < 32) {
    for (; j + 8 <= n; j += 8) {
      const T* kr = k + j * st;
      prefetch_keys(k, st, j);
      T dot[8] = {};
      for (int64_t d = 0; d < r; ++d)
        for (int u = 0; u < 8; ++u) dot[u] += q[d] * kr[u * st + d];
      for (int u = 0; u < 8; ++u) s[j + u] += dot[u];
    }
  }
  for (; j < n; ++j) {
    const T* kr = k + j * st;
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < r; ++d) dot += q[d] * kr[d];
    s[j] += dot;
  }
}

#if defined(__AVX2__)
// The eight lanes' sums of a0..a7, in order: a transposing tree of horizontal adds.
inline __m256 lane_sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  // per 128-bit half: [a0 0+1, a0 2+3, a1 0+1, a1 2+3], and so on
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  const __m256 b2 = _mm256_hadd_ps(a4, a5), b3 = _mm256_hadd_ps(a6, a7);
  // per half: a0..a3's (then a4..a7's) sums over the half's four lanes
  const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

// add_key_scores for float keys of r = 8m dims: eight keys at a time, each key's products summed
// over its 8-dim chunks in one vector, then the eight vectors reduced together, rather than a
// horizontal sum per key, which cost more instructions than the keys' bytes allow. A short last
// group reads its missing keys as zeros, so that a key's score is the same wherever its group
// starts (growing and static caches cut the keys into different runs).
void add_key_scores_by8(const float* q, const float* k, int64_t st, int64_t r, int64_t n, float* s) {
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t m = std::min<int64_t>(8, n - j);
    prefetch_keys(k, st, j);
    __m256 p[8];
    for (int u = 0; u < 8; ++u) {
      p[u] = _mm256_setzero_ps();
      if (u < m)
        for (int64_t c = 0; c < r; c += 8)
          p[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + (j + u) * st + c), p[u]);
    }
    alignas(32) float dot[8];
    _mm256_store_ps(dot, lane_sums8(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]));
    for (int64_t u = 0; u < m; ++u) s[j + u] += dot[u];
  }
}

// float keys: the vector path where the rank allows it (an overload, preferred to the template)
void add_key_scores(const float* q, const float* k, int64_t st, int64_t r, int64_t n, float* s) {
  if (r % 8 == 0) return add_key_scores_by8(q, k, st, r, n, s);
  add_key_scores<float>(q, k, st, r, n, s);
}
#endif

// acc[d] += sum_j w[j] * rows[j * st + d] for n rows of Dv values. The float version keeps the
// row's accumulators in vector registers across all rows (up to 8 vectors: Dv a multiple of the
// vector width up to 128 with AVX-512, 64 with AVX2) and streams each row once; before, with the
// accumulators in memory, a decoding step at a 16k cache ran at about 0.7x its bandwidth.
template <typename T>
void add_weighted_rows(const T* w, const T* rows, int64_t st, int64_t n, int64_t Dv, T* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const T* r = rows + j * st;
    for (int64_t d = 0; d < Dv; ++d) acc[d] += w[j] * r[d];
  }
}

template <int C>
void add_weighted_rows_vec(const float* w, const float* rows, int64_t st, int64_t n, float* acc) {
  Vec a[C];
  for (int c = 0; c < C; ++c) a[c] = Vec::loadu(acc + c * Vec::size());
  for (int64_t j = 0; j < n; ++j) {
    const Vec wj(w[j]);
    const float* r = rows + j * st;
    for (int c = 0; c < C; ++c) a[c] = at::vec::fmadd(wj, Vec::loadu(r + c * Vec::size()), a[c]);
  }
  for (int c = 0; c < C; ++c) a[c].store(acc + c * Vec::size());
}

template <>
void add_weighted_rows<float>(const float* w, const float* rows, int64_t st, int64_t n, int64_t Dv, float* acc) {
  switch (Dv % Vec::size() ? 0 : Dv / Vec::size()) {
    case 1: return add_weighted_rows_vec<1>(w, rows, st, n, acc);
    case 2: return add_weighted_rows_vec<2>(w, rows, st, n, acc);
    case 3: return add_weighted_rows_vec<3>(w, rows, st, n, acc);
    case 4: return add_weighted_rows_vec<4>(w, rows, st, n, acc);
    case 5: return add_weighted_rows_vec<5>(w, rows, st, n, acc);
    case 6: return add_weighted_rows_vec<6>(w, rows, st, n, acc);
    case 7: return add_weighted_rows_vec<7>(w, rows, st, n, acc);
    case 8: return add_weighted_rows_vec<8>(w, rows, st, n, acc);
    default:
      for (int64_t j = 0; j < n; ++j) {
        const float* r = rows + j * st;
        for (int64_t d = 0; d < Dv; ++d) acc[d] += w[j] * r[d];
      }
  }
}

// One decoding step (see reference.py): query (b, h) scores key j with level l where
// j >= starts[l] (level l's keys held are those of the token's own block), then a softmax and the
// values. keys[l] and v are (B, Hk, n, r) views with a contiguous last dim (cache buffers with
// spare capacity). One task per (b, key head) serves that head's G query heads: it streams the
// keys and values once, in chunks that each query head then reads from the core's cache (a task
// per query head streamed them G times, so 2 key heads for 8 query heads, 4x fewer bytes than 8,
// ran only 1.5x faster). Where that leaves fewer tasks than threads, one task per (b, query head)
// instead; the chunks keep each head's sums in the same order either way, so the result has the
// same bits.
// Left-padded rows (row_starts, (B, L) int64, or empty): row b attends from slot row_starts[b][0]
// on and scores level l from max(starts[l], row_starts[b][l]) on.
// Static caches (rings, end): level l's keys sit in a ring of rings[l] slots (position p at p % rings[l];
// 0: at p - starts[l] as above), and the keys end at slot end - 1 of buffers longer than that.
template <typename T>
void decode_kernel(const at::Tensor& q, const std::vector<at::Tensor>& keys, const std::vector<int64_t>& starts,
                   const at::Tensor& v, const at::Tensor& row_starts, at::Tensor& out, double scale,
                   bool depth_normalize, const std::vector<int64_t>& rings, int64_t end) {
  const int64_t B = q.size(0), H = q.size(1), Hk = v.size(1), Dv = v.size(3);
  const int64_t G = H / Hk, L = static_cast<int64_t>(keys.size());
  // query heads per task: the whole group, unless that leaves a thread without work
  const int64_t per_task = B * Hk >= at::get_num_threads() ? G : 1;
  // 8 KiB of 8-dim keys, 16 KiB of 64 values; one query head per task streams them whole
  const int64_t key_chunk = per_task > 1 ? 256 : end, row_chunk = per_task > 1 ? 64 : end;
  std::vector<int64_t> qoff(L + 1, 0);
  for (int64_t l = 0; l < L; ++l) qoff[l + 1] = qoff[l] + keys[l].size(3);
  const T* qp = q.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* rs = row_starts.numel() ? row_starts.data_ptr<int64_t>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * H / per_task, 1, [&](int64_t begin, int64_t stop) {
    std::vector<T> s(per_task * end), depth(depth_normalize ? end : 0), acc(per_task * Dv), sums(per_task);
    std::vector<int64_t> lo(L);
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t b = task * per_task / H, h0 = task * per_task % H, hk = h0 / G;
      for (int64_t l = 0; l < L; ++l)  // clamped, so that no start reaches past the query's own key
        lo[l] = std::min(end - 1, rs ? std::max(starts[l], rs[b * L + l]) : starts[l]);
      const int64_t first = lo[0];
      const T* qrow = qp + b * q.stride(0) + h0 * q.stride(1);
      std::fill(s.begin(), s.end(), T(0));
      if (depth_normalize) std::fill(depth.begin(), depth.end(), T(0));
      for (int64_t l = 0; l < L; ++l) {
        const at::Tensor& k = keys[l];
        const T* kb = k.data_ptr<T>() + b * k.stride(0) + hk * k.stride(1);
        const int64_t r = qoff[l + 1] - qoff[l], st = k.stride(2);
        // the keys of positions [p, p + n) at kr, each chunk scored for every query head
        auto score = [&](const T* kr, int64_t p, int64_t n) {
          for (int64_t c = 0; c < n; c += key_chunk)
            for (int64_t g = 0; g < per_task; ++g)
              add_key_scores(qrow + g * q.stride(1) + qoff[l], kr + c * st, st, r, std::min(key_chunk, n - c),
                             s.data() + g * end + p + c);
        };
        if (rings[l] == 0) {
          score(kb + (lo[l] - starts[l]) * st, lo[l], end - lo[l]);
        } else {  // the held positions [lo, end) in at most two runs of the ring
          for (int64_t p = lo[l]; p < end;) {
            const int64_t at = p % rings[l], run = std::min(end - p, rings[l] - at);
            score(kb + at * st, p, run);
            p += run;
          }
        }
        if (depth_normalize)
          for (int64_t j = lo[l]; j < end; ++j) depth[j] += 1;
      }
      const int64_t n = end - first;
      for (int64_t g = 0; g < per_task; ++g) {
        T* sf = s.data() + g * end + first;
        if (depth_normalize)
          for (int64_t j = 0; j < n; ++j) sf[j] *= T(scale) / depth[first + j];
        else
          for (int64_t j = 0; j < n; ++j) sf[j] *= T(scale);
        sums[g] = exp_shift_sum(sf, n, row_max(sf, n));
      }
      std::fill(acc.begin(), acc.end(), T(0));
      const T* vb = vp + b * v.stride(0) + hk * v.stride(1) + first * v.stride(2);
      for (int64_t c = 0; c < n; c += row_chunk)
        for (int64_t g = 0; g < per_task; ++g)
          add_weighted_rows(s.data() + g * end + first + c, vb + c * v.stride(2), v.stride(2),
                            std::min(row_chunk, n - c), Dv, acc.data() + g * Dv);
      for (int64_t g = 0; g < per_task; ++g) {
        T* orow = op + (b * H + h0 + g) * Dv;
        for (int64_t d = 0; d < Dv; ++d) orow[d] = acc[g * Dv + d] / sums[g];
      }
    }
  });
}

Levels make_levels(const std::vector<int64_t>& sizes, const std::vector<int64_t>& offsets) {
  TORCH_CHECK(!sizes.empty() && offsets.size() == sizes.size() + 1, "mlr_cpu: one offset per level plus R_0 = 0");
  return Levels{sizes, offsets};
}

void check_input(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 4 && t.stride(3) == 1, "mlr_cpu: ", name,
              " must be a 4-D CPU tensor with a contiguous last dim");
  TORCH_CHECK(t.scalar_type() == q.scalar_type() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble),
              "mlr_cpu: ", name, " must be float32 or float64, of q's dtype");
  TORCH_CHECK(t.size(0) == q.size(0) && t.size(2) == q.size(2) && q.size(1) % t.size(1) == 0, "mlr_cpu: ", name,
              " must be (B, Hk, T, *) with q's B and T and Hk dividing q's H");
}

// The dims' order (empty: as they come), checked to be a permutation of range(R).
DimOrder dims_order(std::vector<int64_t> order, int64_t R) {
  if (order.empty()) order = iota(R);
  std::vector<int64_t> pos(R, -1);
  for (int64_t c = 0; c < static_cast<int64_t>(order.size()); ++c) {
    TORCH_CHECK(order.size() == static_cast<size_t>(R) && order[c] >= 0 && order[c] < R && pos[order[c]] < 0,
                "mlr_cpu: order must be a permutation of the head dims");
    pos[order[c]] = c;
  }
  return {pos, order == iota(R)};
}

// (B, H, T, D) as a view of fresh (B, T, H, D) memory.
at::Tensor heads_view(const at::Tensor& like, int64_t B, int64_t H, int64_t T, int64_t D) {
  return at::empty({B, T, H, D}, like.options()).transpose(1, 2);
}

}  // namespace

std::vector<at::Tensor> mlr_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& segments, std::vector<int64_t> sizes,
                                    std::vector<int64_t> offsets, std::vector<int64_t> order, double scale,
                                    bool causal, bool depth_normalize, int64_t bq, int64_t bk) {
  RECORD_FUNCTION("sattn::mlr_cpu_forward_kernel", std::vector<c10::IValue>());
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_input(*t, q, name);
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(1) == k.size(1), "mlr_cpu: k must be (B, Hk, T, R), v (B, Hk, T, Dv)");
  const Levels lv = make_levels(sizes, offsets);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2);
  auto out = heads_view(q, B, H, T, v.size(3));
  auto lse = at::empty({B, H, T}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mlr_forward", [&] {
    forward_kernel<scalar_t>(q, k, v, out, lse, make_segments(segments, B * H, T), lv, dims_order(order, q.size(3)),
                             scalar_t(scale), causal, depth_normalize, bq, bk);
  });
  return {out, lse};
}

std::vector<at::Tensor> mlr_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& out, const at::Tensor& gout, const at::Tensor& lse,
                                     const at::Tensor& segments, std::vector<int64_t> sizes,
                                     std::vector<int64_t> offsets, std::vector<int64_t> order, double scale,
                                     bool causal, bool depth_normalize, int64_t bq, int64_t bk) {
  RECORD_FUNCTION("sattn::mlr_cpu_backward_kernel", std::vector<c10::IValue>());
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&gout, "gout"}})
    check_input(*t, q, name);
  TORCH_CHECK(lse.is_contiguous() && lse.sizes() == q.sizes().slice(0, 3), "mlr_cpu: lse must be a contiguous (B, H, T)");
  const Levels lv = make_levels(sizes, offsets);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2);
  auto dq = heads_view(q, B, H, T, q.size(3));
  auto dk = heads_view(q, B, H, T, q.size(3));
  auto dv = heads_view(q, B, H, T, v.size(3));
  // Positions outside every segment (none when the segments tile the rows) get zero gradients.
  if (segments.numel()) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mlr_backward", [&] {
    backward_kernel<scalar_t>(q, k, v, out, gout, lse, dq, dk, dv, make_segments(segments, B * H, T), lv,
                              dims_order(order, q.size(3)), scalar_t(scale), causal, depth_normalize, bq, bk);
  });
  return {dq, dk, dv};
}

// The checks both decoding entries share; returns the output to fill.
at::Tensor mlr_decode_checked(const at::Tensor& q, const std::vector<at::Tensor>& keys, const at::Tensor& v,
                              const at::Tensor& row_starts) {
  TORCH_CHECK(q.dim() == 3 && v.dim() == 4 && q.stride(2) == 1 && v.stride(3) == 1,
              "mlr_cpu: decode takes q (B, H, R) and v (B, Hk, T, Dv) with a contiguous last dim");
  TORCH_CHECK(!keys.empty(), "mlr_cpu: one key view per level");
  for (const auto& k : keys)
    TORCH_CHECK(k.dim() == 4 && k.stride(3) == 1 && k.scalar_type() == q.scalar_type() && k.device().is_cpu(),
                "mlr_cpu: decode keys must be (B, Hk, n, r) CPU views with a contiguous last dim, of q's dtype");
  TORCH_CHECK(v.scalar_type() == q.scalar_type() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "mlr_cpu: decode takes float32 or float64");
  TORCH_CHECK(row_starts.numel() == 0 || (row_starts.scalar_type() == at::kLong && row_starts.is_contiguous() &&
                                           row_starts.dim() == 2 && row_starts.size(0) == q.size(0) &&
                                           row_starts.size(1) == static_cast<int64_t>(keys.size())),
              "mlr_cpu: decode row_starts must be empty or a contiguous (B, L) int64 tensor");
  return at::empty({q.size(0), q.size(1), v.size(3)}, q.options());
}

at::Tensor mlr_decode(const at::Tensor& q, const std::vector<at::Tensor>& keys, std::vector<int64_t> starts,
                      const at::Tensor& v, double scale, bool depth_normalize, const at::Tensor& row_starts) {
  RECORD_FUNCTION("sattn::mlr_cpu_decode_kernel", std::vector<c10::IValue>());
  TORCH_CHECK(keys.size() == starts.size(), "mlr_cpu: one key view and start per level");
  auto out = mlr_decode_checked(q, keys, v, row_starts);
  const std::vector<int64_t> rings(keys.size(), 0);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mlr_decode", [&] {
    decode_kernel<scalar_t>(q, keys, starts, v, row_starts, out, scale, depth_normalize, rings, v.size(2));
  });
  return out;
}

// One decoding step against a static cache: level 1's keys and the values at their slots, level
// l > 1's keys in a ring of rings[l] slots; the token at slot `slot` (a 0-d int64 CPU tensor) is
// the last key; row_starts (B, L) each row's first slot per level (its padding, then its blocks).
at::Tensor mlr_decode_static(const at::Tensor& q, const std::vector<at::Tensor>& keys, const at::Tensor& v,
                             const at::Tensor& slot, const at::Tensor& row_starts, std::vector<int64_t> rings,
                             double scale, bool depth_normalize) {
  RECORD_FUNCTION("sattn::mlr_cpu_decode_static_kernel", std::vector<c10::IValue>());
  TORCH_CHECK(slot.numel() == 1 && slot.scalar_type() == at::kLong && slot.device().is_cpu(),
              "mlr_cpu: decode_static takes the slot as a one-element int64 CPU tensor");
  TORCH_CHECK(rings.size() == keys.size() && row_starts.numel() > 0, "mlr_cpu: one ring size per level and row starts");
  const int64_t end = slot.item<int64_t>() + 1;
  TORCH_CHECK(end >= 1 && end <= v.size(2), "mlr_cpu: decode_static's slot is outside the buffers");
  auto out = mlr_decode_checked(q, keys, v, row_starts);
  const std::vector<int64_t> starts(keys.size(), 0);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mlr_decode_static", [&] {
    decode_kernel<scalar_t>(q, keys, starts, v, row_starts, out, scale, depth_normalize, rings, end);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &mlr_forward, "MLR attention forward: (out, lse)");
  m.def("backward", &mlr_backward, "MLR attention backward: (dq, dk, dv), dk and dv per query head");
  m.def("decode", &mlr_decode, "one MLR decoding step against the compressed cache: (B, H, Dv)");
  m.def("decode_static", &mlr_decode_static, "one MLR decoding step against a static cache (rings): (B, H, Dv)");
}
