// orb's k-nearest-neighbour edges on the host: for every atom, the k nearest candidate images
// (atom positions plus the given lattice translations) closer than a cutoff, itself excluded.
// Called through ctypes by orb/data/neighbours.py, which has the same search in scipy as fallback.
//
// Candidates j = image * n + atom are binned in a cell list over their bounding box; each atom
// searches shells of cells around its own until the k-th nearest found is closer than anything
// outside the searched block, or the block reaches past the cutoff. Distances are computed in
// double from the float32 coordinates (as scipy's k-d tree does); equal distances are ordered by
// candidate index, so the graph does not depend on the search order. Candidate positions and
// edge vectors are float32 sums and differences, bit for bit what numpy computes.
// Build: see orb/native.py (its flags, once per machine).
//
// No fused multiply-adds: -march=native would otherwise fuse the squared distance's products and
// sums on CPUs that have FMA, so near-equal distances (and the graph) would depend on the host.
#pragma GCC optimize("fp-contract=off")
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

namespace {

// The k best (smallest squared distance, then smallest index) candidates seen so far, sorted.
struct Nearest {
  int32_t k;
  int32_t count;
  double* d2;
  int64_t* index;

  bool before(double d, int64_t j, int32_t slot) const { return d < d2[slot] || (d == d2[slot] && j < index[slot]); }

  void offer(double d, int64_t j) {
    if (count == k && !before(d, j, k - 1)) return;
    int32_t slot = count < k ? count++ : k - 1;
    for (; slot > 0 && before(d, j, slot - 1); --slot) {
      d2[slot] = d2[slot - 1];
      index[slot] = index[slot - 1];
    }
    d2[slot] = d;
    index[slot] = j;
  }
};

struct CellList {
  double lo[3];
  double h;
  int64_t dim[3];
  std::vector<int64_t> start;  // candidates of cell c: order[start[c]] .. order[start[c + 1] - 1]
  std::vector<int64_t> order;

  int64_t coord(double v, int a) const {
    const int64_t c = static_cast<int64_t>((v - lo[a]) / h);
    return std::max<int64_t>(0, std::min(c, dim[a] - 1));
  }

  int64_t cell(const float* p) const { return (coord(p[0], 0) * dim[1] + coord(p[1], 1)) * dim[2] + coord(p[2], 2); }

  // About two candidates per cell, never more cells than 8 per candidate (flat or sparse systems).
  CellList(const float* cand, int64_t m) {
    double hi[3];
    for (int a = 0; a < 3; ++a) {
      lo[a] = INFINITY;
      hi[a] = -INFINITY;
    }
    for (int64_t j = 0; j < m; ++j)
      for (int a = 0; a < 3; ++a) {
        lo[a] = std::min(lo[a], static_cast<double>(cand[3 * j + a]));
        hi[a] = std::max(hi[a], static_cast<double>(cand[3 * j + a]));
      }
    double extent[3], volume = 1.0, longest = 0.0;
    for (int a = 0; a < 3; ++a) {
      extent[a] = hi[a] - lo[a];
      volume *= std::max(extent[a], 1e-3);
      longest = std::max(longest, extent[a]);
    }
    h = std::max({std::cbrt(volume * 2.0 / static_cast<double>(m)), longest / 256.0, 1e-3});
    for (;; h *= 1.5) {
      for (int a = 0; a < 3; ++a) dim[a] = static_cast<int64_t>(extent[a] / h) + 1;
      if (dim[0] * dim[1] * dim[2] <= 8 * m + 64) break;
    }
    const int64_t cells = dim[0] * dim[1] * dim[2];
    start.assign(cells + 1, 0);
    order.resize(m);
    std::vector<int64_t> home(m);
    for (int64_t j = 0; j < m; ++j) {
      home[j] = cell(cand + 3 * j);
      ++start[home[j] + 1];
    }
    for (int64_t c = 0; c < cells; ++c) start[c + 1] += start[c];
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t j = 0; j < m; ++j) order[fill[home[j]]++] = j;
  }

  // Distance from q (in cell c) to the nearest point outside the block of cells within s of c;
  // infinite when the block covers the whole grid.
  double reach(const double* q, const int64_t* c, int64_t s) const {
    double r = INFINITY;
    for (int a = 0; a < 3; ++a) {
      if (c[a] - s > 0) r = std::min(r, q[a] - (lo[a] + static_cast<double>(c[a] - s) * h));
      if (c[a] + s + 1 < dim[a]) r = std::min(r, lo[a] + static_cast<double>(c[a] + s + 1) * h - q[a]);
    }
    return r;
  }
};

void search(const CellList& grid, const float* cand, const double* q, int64_t self, double cutoff2, Nearest& best) {
  const int64_t c[3] = {grid.coord(q[0], 0), grid.coord(q[1], 1), grid.coord(q[2], 2)};
  for (int64_t s = 0;; ++s) {
    for (int64_t dz = -s; dz <= s; ++dz) {
      const int64_t z = c[2] + dz;
      if (z < 0 || z >= grid.dim[2]) continue;
      for (int64_t dy = -s; dy <= s; ++dy) {
        const int64_t y = c[1] + dy;
        if (y < 0 || y >= grid.dim[1]) continue;
        // the shell at distance s: every x on its faces, only x = c -/+ s inside
        const bool face = s == 0 || dz == -s || dz == s || dy == -s || dy == s;
        for (int64_t dx = -s; dx <= s; dx += face ? 1 : 2 * s) {
          const int64_t x = c[0] + dx;
          if (x < 0 || x >= grid.dim[0]) continue;
          const int64_t cell = (x * grid.dim[1] + y) * grid.dim[2] + z;
          for (int64_t p = grid.start[cell]; p < grid.start[cell + 1]; ++p) {
            const int64_t j = grid.order[p];
            const double ex = static_cast<double>(cand[3 * j]) - q[0];
            const double ey = static_cast<double>(cand[3 * j + 1]) - q[1];
            const double ez = static_cast<double>(cand[3 * j + 2]) - q[2];
            const double d = ex * ex + ey * ey + ez * ez;
            if (d < cutoff2 && j != self) best.offer(d, j);
          }
        }
      }
    }
    const double r = grid.reach(q, c, s);
    if (r == INFINITY || r * r >= cutoff2) return;                      // nothing closer is left outside
    if (best.count == best.k && best.d2[best.k - 1] < r * r) return;  // the k found beat everything outside
  }
}

}  // namespace

// positions (n, 3), translations (t, 3), shifts (t, 3): float32. Candidate j = image * n + atom is
// positions[atom] + translations[image]; atom i's own candidate is self_image * n + i. Writes up to
// n * k edges, grouped by sender, nearest first: senders, receivers (atom index), vectors (candidate
// minus sender) and out_shifts (shifts[image]). Returns the number of edges, or -1 if out of memory.
extern "C" int64_t orb_knn_edges(const float* positions, int64_t n, const float* translations, const float* shifts,
                                 int64_t t, int64_t self_image, int32_t k, double cutoff, int64_t* senders,
                                 int64_t* receivers, float* vectors, float* out_shifts) {
  if (n <= 0 || t <= 0 || k <= 0) return 0;
  try {
    const int64_t m = n * t;
    std::vector<float> cand(3 * m);
    for (int64_t image = 0; image < t; ++image)
      for (int64_t atom = 0; atom < n; ++atom)
        for (int a = 0; a < 3; ++a)
          cand[3 * (image * n + atom) + a] = positions[3 * atom + a] + translations[3 * image + a];
    const CellList grid(cand.data(), m);
    std::vector<double> d2(k);
    std::vector<int64_t> index(k);
    int64_t edges = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double q[3] = {positions[3 * i], positions[3 * i + 1], positions[3 * i + 2]};
      Nearest best{k, 0, d2.data(), index.data()};
      search(grid, cand.data(), q, self_image * n + i, cutoff * cutoff, best);
      for (int32_t b = 0; b < best.count; ++b, ++edges) {
        const int64_t j = index[b], image = j / n;
        senders[edges] = i;
        receivers[edges] = j % n;
        for (int a = 0; a < 3; ++a) {
          vectors[3 * edges + a] = cand[3 * j + a] - positions[3 * i + a];
          out_shifts[3 * edges + a] = shifts[3 * image + a];
        }
      }
    }
    return edges;
  } catch (const std::bad_alloc&) {
    return -1;
  }
}
