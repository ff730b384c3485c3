// The per-call checks of the offsets the ops follow into a packed tensor: bitmap_linear's row offsets into
// `values`, bitmap-q4's row offsets into `codes` (bitmap_q4_linear, bitmap_q4_pack_pairs, bitmap_q4_validate)
// and the pair layout's block offsets and pass headers (bitmap_q4_i8_linear, in bitmap_q4_i8/op.cpp). Unless the caller checked the
// layout once (`checked=True`: the vLLM layer at load), each op runs them before its kernels read anything,
// so a corrupt offset raises a RuntimeError naming it instead of reading outside the tensor (a segfault) or
// multiplying the wrong weights (a row offset one byte off). One pass over the rows (blocks), split over
// ATen's threads: each row must end where the next one starts (the last one at the tensor's end) by the
// bitmap's popcounts, which with the first offset at 0 also makes the offsets non-decreasing and inside the
// tensor. Plain C++ with ATen; the popcounts use the instruction (a CPU without it counts in software).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "common/types.h"  // LEAP_ALWAYS_INLINE

namespace leap_sparse {
namespace {

// Rows (blocks) per task of a check: about 2^20 bits of bitmap (masks) each.
inline int64_t check_grain(int64_t row_bits) { return std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(row_bits, 1)); }

// Values of one `bitmap` row of `bytes` bytes: its set bits.
LEAP_ALWAYS_INLINE int64_t row_values(const uint8_t* row, int64_t bytes) {
  int64_t count = 0, i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, row + i, 8);
    count += __builtin_popcountll(word);
  }
  for (; i < bytes; ++i) count += __builtin_popcount(row[i]);
  return count;
}

// Bytes of codes of one bitmap-q4 row of `words` 32-column words: ceil(popcount / 2) per word.
LEAP_ALWAYS_INLINE int64_t row_code_bytes(const uint8_t* row, int64_t words) {
  int64_t bytes = 0, w = 0;
  for (; w + 2 <= words; w += 2) {
    uint64_t two;
    std::memcpy(&two, row + 4 * w, 8);
    bytes += ((__builtin_popcount(static_cast<uint32_t>(two)) + 1) >> 1) +
             ((__builtin_popcount(static_cast<uint32_t>(two >> 32)) + 1) >> 1);
  }
  if (w < words) {
    uint32_t word;
    std::memcpy(&word, row + 4 * w, 4);
    bytes += (__builtin_popcount(word) + 1) >> 1;
  }
  return bytes;
}

// Where a packed tensor's rows (blocks) lie: `offsets[r]` (int32 or int64) of row r, `total` the element after
// the last row, `size(r)` its elements by the bitmap (masks).
template <typename Offset, typename Size>
struct Extents {
  const Offset* offsets;
  int64_t rows;
  int64_t total;
  Size size;

  LEAP_ALWAYS_INLINE int64_t end(int64_t r) const { return r + 1 < rows ? static_cast<int64_t>(offsets[r + 1]) : total; }
  LEAP_ALWAYS_INLINE bool fits(int64_t r) const { return end(r) - static_cast<int64_t>(offsets[r]) == size(r); }
};

// The first row of begin..end that does not end where the next one starts, else end.
template <typename E>
LEAP_ALWAYS_INLINE int64_t first_misfit(const E& e, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    if (!e.fits(r)) return r;
  }
  return end;
}

// first_misfit compiled with the popcount instruction (the inlined counts use it).
template <typename E>
__attribute__((target("popcnt"))) int64_t first_misfit_popcnt(const E& e, int64_t begin, int64_t end) {
  return first_misfit(e, begin, end);
}

// The first row of all that does not fit (rows when all do), over ATen's threads.
template <typename E>
int64_t first_misfit_row(const E& e, int64_t grain) {
  static const bool popcnt = __builtin_cpu_supports("popcnt");
  std::atomic<int64_t> first{e.rows};
  at::parallel_for(0, e.rows, grain, [&](int64_t begin, int64_t end) {
    const int64_t found = popcnt ? first_misfit_popcnt(e, begin, end) : first_misfit(e, begin, end);
    int64_t seen = first.load();
    while (found < seen && !first.compare_exchange_weak(seen, found)) {
    }
  });
  return first.load();
}

// What a check's message calls things: the offsets' name, a row ("row", "block"), what sizes them ("the bitmap
// puts", "the bitmap needs"), the elements counted ("value", "code byte"), the packed tensor, what to do.
struct Names {
  const char* offsets;
  const char* row;
  const char* source;
  const char* needs;
  const char* element;
  const char* tensor;
  const char* hint;
};

// Raises the error naming the first offset (or the total) that disagrees with the counts, if one does.
template <typename E>
void check_extents(const char* op, const E& e, int64_t grain, const Names& n) {
  if (e.rows == 0) {
    TORCH_CHECK(e.total == 0, op, ": no ", n.row, "s need no ", n.element, "s, ", n.tensor, " holds ", e.total,
                " (", n.hint, ")");
    return;
  }
  TORCH_CHECK(e.offsets[0] == 0, op, ": ", n.offsets, "[0] is ", static_cast<int64_t>(e.offsets[0]), ", but the first ",
              n.element, " is at 0 (", n.hint, ")");
  const int64_t r = first_misfit_row(e, grain);
  if (r == e.rows) return;
  // Every row before r fits, so offsets[r] is where row r starts: offsets[r + 1] (or the total) is wrong.
  const int64_t expected = static_cast<int64_t>(e.offsets[r]) + e.size(r);
  TORCH_CHECK(r + 1 == e.rows, op, ": ", n.offsets, "[", r + 1, "] is ", static_cast<int64_t>(e.offsets[r + 1]),
              ", but ", n.source, " that ", n.row, "'s first ", n.element, " at ", expected, " (", n.hint, ")");
  TORCH_CHECK(false, op, ": ", n.needs, " ", expected, " ", n.element, "s, ", n.tensor, " holds ", e.total, " (",
              n.hint, ")");
}

constexpr Names kBitmapNames{"row_offsets", "row", "the bitmap puts", "the bitmap needs", "value", "values",
                             "check the layout with sparse_formats.get_format('bitmap').check; checked=True only for a "
                             "layout checked once"};
constexpr Names kQ4Names{"row_offsets", "row", "the bitmap puts", "the bitmap needs", "code byte", "codes",
                         "check the layout with sparse_formats.get_format('bitmap-q4').check; checked=True only for a "
                         "layout checked once"};
// Row (block) sizes by the bitmap (masks), as functors the checks inline (lambdas might not be, and would then
// count without the popcount instruction).
struct RowValues {  // bitmap_linear: one value per set bit of each row of `stride` bytes
  const uint8_t* bitmap;
  int64_t stride;
  LEAP_ALWAYS_INLINE int64_t operator()(int64_t r) const { return row_values(bitmap + r * stride, stride); }
};
struct RowCodeBytes {  // bitmap-q4: ceil(popcount / 2) bytes per 32-column word, `words` a row
  const uint8_t* bitmap;
  int64_t words;
  LEAP_ALWAYS_INLINE int64_t operator()(int64_t r) const { return row_code_bytes(bitmap + 4 * r * words, words); }
};

// bitmap_linear: int64 row_offsets into `values` (n_values), one value per set bit of each row (`stride` bytes).
inline void check_bitmap_offsets(const char* op, const uint8_t* bitmap, int64_t stride, const int64_t* offsets,
                                 int64_t rows, int64_t n_values) {
  const Extents<int64_t, RowValues> e{offsets, rows, n_values, RowValues{bitmap, stride}};
  check_extents(op, e, check_grain(8 * stride), kBitmapNames);
}

// bitmap-q4: int32 row_offsets into `codes` (n_codes bytes).
inline void check_q4_offsets(const char* op, const uint8_t* bitmap, int64_t n_cols, const int32_t* offsets,
                             int64_t rows, int64_t n_codes) {
  const Extents<int32_t, RowCodeBytes> e{offsets, rows, n_codes, RowCodeBytes{bitmap, n_cols / 32}};
  check_extents(op, e, check_grain(n_cols), kQ4Names);
}

}  // namespace
}  // namespace leap_sparse
