// Accurate, vectorisable float32 shifted softplus and its derivative for MindSpore's CPU backend
// (ops.Custom, func_type "aot"). MindSpore's CPU Softplus/Exp kernels are accurate to only
// ~3e-6 absolute (tens of ulps); these stay within ~1 ulp and auto-vectorise with -O3.
//
// ssp(x) = softplus(x) - ln 2 = (max(x, 0) - ln 2) + log1p(exp(-|x|))
// d ssp(x) / dx = sigmoid(x)
// exp(min(x, 0)) for the Gaussian radial basis functions.
// Build: see orb/native.py (its flags, once per machine).
#include <cstdint>
#include <cstring>

namespace {

// exp(y) for y <= 0: y = n ln2 + r, |r| <= ln2/2, exp(r) by its Taylor series to r^7.
inline float exp_nonpositive(float y) {
  y = y < -87.0f ? -87.0f : y;
  const float n = __builtin_floorf(y * 1.44269504088896341f + 0.5f);
  const float r = (y - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// log1p(t) for t in [0, 1]: 2 atanh(s), s = t / (2 + t) in [0, 1/3].
inline float log1p_unit(float t) {
  const float s = t / (2.0f + t);
  const float s2 = s * s;
  float p = 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return 2.0f * s * p;
}

int64_t numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

}  // namespace

// Shifted softplus, orb's activation: softplus(x) - ln 2 (one pass instead of two).
extern "C" int OrbShiftedSoftplus(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *,
                                  void *) {
  if (nparam != 2) return 1;
  const float *__restrict x = static_cast<const float *>(params[0]);
  float *__restrict y = static_cast<float *>(params[1]);
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float a = v < 0.0f ? -v : v;
    y[i] = ((v > 0.0f ? v : 0.0f) - 0.693147180559945309f) + log1p_unit(exp_nonpositive(-a));
  }
  return 0;
}

extern "C" int OrbSoftplusGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 3) return 1;
  const float *__restrict x = static_cast<const float *>(params[0]);
  const float *__restrict dy = static_cast<const float *>(params[1]);
  float *__restrict dx = static_cast<float *>(params[2]);
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float e = exp_nonpositive(v < 0.0f ? v : -v);
    const float sig = (v >= 0.0f ? 1.0f : e) / (1.0f + e);
    dx[i] = dy[i] * sig;
  }
  return 0;
}

extern "C" int OrbExpNonpositive(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *,
                                 void *) {
  if (nparam != 2) return 1;
  const float *__restrict x = static_cast<const float *>(params[0]);
  float *__restrict y = static_cast<float *>(params[1]);
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = exp_nonpositive(v < 0.0f ? v : 0.0f);
  }
  return 0;
}

namespace {

// sigmoid(v) to ~1 ulp: e = exp(-|v|), sigmoid = 1 / (1 + e) for v >= 0, e / (1 + e) otherwise.
inline float sigmoid(float v) {
  const float e = exp_nonpositive(v < 0.0f ? v : -v);
  return (v >= 0.0f ? 1.0f : e) / (1.0f + e);
}

}  // namespace

// SiLU, orb-v3's activation: x * sigmoid(x).
extern "C" int OrbSilu(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 2) return 1;
  const float *__restrict x = static_cast<const float *>(params[0]);
  float *__restrict y = static_cast<float *>(params[1]);
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * sigmoid(x[i]);
  return 0;
}

// g * silu'(x), silu'(x) = s (1 + x (1 - s)).
extern "C" int OrbSiluGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 3) return 1;
  const float *__restrict x = static_cast<const float *>(params[0]);
  const float *__restrict g = static_cast<const float *>(params[1]);
  float *__restrict out = static_cast<float *>(params[2]);
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(x[i]);
    out[i] = g[i] * (s * (1.0f + x[i] * (1.0f - s)));
  }
  return 0;
}

// g * silu''(x), silu''(x) = s (1 - s) (2 + x (1 - 2 s)): the second derivative conservative models train with.
extern "C" int OrbSiluGrad2(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 3) return 1;
  const float *__restrict x = static_cast<const float *>(params[0]);
  const float *__restrict g = static_cast<const float *>(params[1]);
  float *__restrict out = static_cast<float *>(params[2]);
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(x[i]);
    out[i] = g[i] * (s * (1.0f - s) * (2.0f + x[i] * (1.0f - 2.0f * s)));
  }
  return 0;
}

namespace {

constexpr int kLanes = 16;  // independent partial sums: vectorised without reassociating one sum (no -ffast-math)

// every input and the output float32 (a half-precision array read as floats would be garbage, not an error)
inline bool all_float32(int nparam, const char **types) {
  for (int k = 0; k < nparam; ++k) {
    if (types == nullptr || types[k] == nullptr || std::strcmp(types[k], "float32") != 0) return false;
  }
  return true;
}

// sum over a row of x[j], in double lanes: a float sum of a row far from zero (mean 50, spread 0.01) rounds away
// the spread the mean is subtracted to keep
inline double row_total(const float *__restrict x, int64_t width) {
  double lanes[kLanes] = {0.0};
  int64_t j = 0;
  for (; j + kLanes <= width; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) lanes[k] += x[j + k];
  }
  double total = 0.0;
  for (int k = 0; k < kLanes; ++k) total += lanes[k];
  for (; j < width; ++j) total += x[j];
  return total;
}

// sum over a row of ((x[j] - hi) - lo)^2, in double lanes (as fast as float ones here: the pass is not the cost)
inline double row_square_total(const float *__restrict x, int64_t width, float hi, float lo) {
  double lanes[kLanes] = {0.0};
  int64_t j = 0;
  for (; j + kLanes <= width; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float d = (x[j + k] - hi) - lo;
      lanes[k] += static_cast<double>(d) * d;
    }
  }
  double total = 0.0;
  for (int k = 0; k < kLanes; ++k) total += lanes[k];
  for (; j < width; ++j) {
    const double d = (static_cast<double>(x[j]) - hi) - lo;
    total += d * d;
  }
  return total;
}

}  // namespace

// LayerNorm over the last axis, (x - mean) / sqrt(var + eps) * w + b (biased variance, PyTorch's), one row at a
// time in the cache: MindSpore 2.10's CPU LayerNorm took 4.7 ns an element, 10 % of a full orb-v2 call. eps is the
// fourth input (a float32 scalar), so one kernel serves every model.
extern "C" int OrbLayerNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **types, void *,
                            void *) {
  if (nparam != 5 || ndims[0] < 1 || !all_float32(nparam, types)) return 1;
  const float *__restrict x = static_cast<const float *>(params[0]);
  const float *__restrict w = static_cast<const float *>(params[1]);
  const float *__restrict b = static_cast<const float *>(params[2]);
  const double eps = *static_cast<const float *>(params[3]);
  float *__restrict y = static_cast<float *>(params[4]);
  const int64_t width = shapes[0][ndims[0] - 1];
  if (numel(ndims[1], shapes[1]) != width || numel(ndims[2], shapes[2]) != width) return 1;
  if (width <= 0) return 0;
  const int64_t rows = numel(ndims[0], shapes[0]) / width;
  for (int64_t r = 0; r < rows; ++r) {
    const float *__restrict xr = x + r * width;
    float *__restrict yr = y + r * width;
    // the mean (summed in double) as two floats, hi + lo: x - hi is exact near the mean
    const double mean = row_total(xr, width) / width;
    const float hi = static_cast<float>(mean), lo = static_cast<float>(mean - hi);
    const double var = row_square_total(xr, width, hi, lo) / width;
    const float rstd = static_cast<float>(1.0 / __builtin_sqrt(var + eps));
    for (int64_t j = 0; j < width; ++j) yr[j] = ((xr[j] - hi) - lo) * rstd * w[j] + b[j];
  }
  return 0;
}

// RMSNorm over the last axis, x / sqrt(mean(x^2) + eps) * w (orb-v3's); eps the third input (float32 scalar).
extern "C" int OrbRMSNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **types, void *,
                          void *) {
  if (nparam != 4 || ndims[0] < 1 || !all_float32(nparam, types)) return 1;
  const float *__restrict x = static_cast<const float *>(params[0]);
  const float *__restrict w = static_cast<const float *>(params[1]);
  const double eps = *static_cast<const float *>(params[2]);
  float *__restrict y = static_cast<float *>(params[3]);
  const int64_t width = shapes[0][ndims[0] - 1];
  if (numel(ndims[1], shapes[1]) != width) return 1;
  if (width <= 0) return 0;
  const int64_t rows = numel(ndims[0], shapes[0]) / width;
  for (int64_t r = 0; r < rows; ++r) {
    const float *__restrict xr = x + r * width;
    float *__restrict yr = y + r * width;
    const double mean_square = row_square_total(xr, width, 0.0f, 0.0f) / width;
    const float rstd = static_cast<float>(1.0 / __builtin_sqrt(mean_square + eps));
    for (int64_t j = 0; j < width; ++j) yr[j] = xr[j] * rstd * w[j];
  }
  return 0;
}

// The first layer of an edge MLP, finished per edge in one pass: y[e] = (x[e] + (t[s[e], :w] + bias)) + t[r[e], w:]
// for x (E, w) the edge part of the product, t (N, 2w) the nodes' sender and receiver parts side by side, s and r
// the edges' senders and receivers (int32). The same operations in the same order as the composed form (the bias
// added to a node's row, two gathers, two adds: the same bits), without its (E, w) intermediates. An index outside
// the table fails the kernel (MindSpore raises), never reads another row.
extern "C" int OrbEdgeInput(int nparam, void **params, int *ndims, int64_t **shapes, const char **types, void *,
                            void *) {
  if (nparam != 6 || ndims[0] != 2 || ndims[1] != 2 || types == nullptr) return 1;
  for (int k = 0; k < nparam; ++k) {
    const char *wanted = (k == 3 || k == 4) ? "int32" : "float32";
    if (types[k] == nullptr || std::strcmp(types[k], wanted) != 0) return 1;
  }
  const float *__restrict x = static_cast<const float *>(params[0]);
  const float *__restrict t = static_cast<const float *>(params[1]);
  const float *__restrict bias = static_cast<const float *>(params[2]);
  const int32_t *__restrict s = static_cast<const int32_t *>(params[3]);
  const int32_t *__restrict r = static_cast<const int32_t *>(params[4]);
  float *__restrict y = static_cast<float *>(params[5]);
  const int64_t edges = shapes[0][0], width = shapes[0][1], nodes = shapes[1][0];
  if (shapes[1][1] != 2 * width || numel(ndims[2], shapes[2]) != width || numel(ndims[3], shapes[3]) != edges ||
      numel(ndims[4], shapes[4]) != edges) {
    return 1;
  }
  for (int64_t e = 0; e < edges; ++e) {
    if (s[e] < 0 || s[e] >= nodes || r[e] < 0 || r[e] >= nodes) return 1;
  }
  for (int64_t e = 0; e < edges; ++e) {
    const float *__restrict xe = x + e * width;
    const float *__restrict from_sender = t + static_cast<int64_t>(s[e]) * 2 * width;
    const float *__restrict from_receiver = t + static_cast<int64_t>(r[e]) * 2 * width + width;
    float *__restrict ye = y + e * width;
    for (int64_t j = 0; j < width; ++j) ye[j] = (xe[j] + (from_sender[j] + bias[j])) + from_receiver[j];
  }
  return 0;
}

// Each kernel's output has its first input's shape. MindSpore calls these when a graph's input shapes are dynamic
// (a prediction graph compiled once for structures of every size); the Python out_shape cannot be used there.
#include <vector>
class AotExtra;
#define ORB_SAME_SHAPE(name)                                                                   \
  extern "C" std::vector<int64_t> name##InferShape(int *ndims, int64_t **shapes, AotExtra *) { \
    return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);                              \
  }
ORB_SAME_SHAPE(OrbShiftedSoftplus)
ORB_SAME_SHAPE(OrbSoftplusGrad)
ORB_SAME_SHAPE(OrbExpNonpositive)
ORB_SAME_SHAPE(OrbSilu)
ORB_SAME_SHAPE(OrbSiluGrad)
ORB_SAME_SHAPE(OrbSiluGrad2)
ORB_SAME_SHAPE(OrbLayerNorm)
ORB_SAME_SHAPE(OrbRMSNorm)
ORB_SAME_SHAPE(OrbEdgeInput)
