// Many activation rows on bfloat16 panels through AMX's tiles (builds with AMX-BF16: Intel
// Sapphire Rapids and later): `tdpbf16ps` multiplies a 16-row tile of activations (32
// bfloat16 each) by a 16-pair tile of a panel (16 outputs) into 16 x 16 float32 sums, 8192
// multiply-adds an instruction where AVX512-BF16's `vdpbf16ps` does 32. A panel's layout
// (bf16_panels.h: [K/2, 32, 2], a 128-byte line per k pair) is a tile's as it stands: 16
// lines of 64 bytes, 128 apart, for outputs 0-15 of the panel; the next 64 bytes for 16-31.
// Each tile of sums adds its pairs' two products apart and the two at the end (the SDM's
// `tdpbf16ps`), not in `vdpbf16ps`' order: the same rows on the two paths round apart, but
// a row's result here does not depend on the rows beside it (rows past M are zeros).
#pragma once

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#endif

namespace {

constexpr int64_t AMX_ROWS = 16;  // fewest activation rows on the tiles (fewer: vdpbf16ps)
constexpr int64_t AMX_BLOCK = 32;  // activation rows a pass (two tiles of 16)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

// The tiles as amx_panel_rows uses them: tmm0-3 sums (16 rows x 16 float32), tmm4-5
// activations (16 rows x 32 bfloat16), tmm6-7 a panel's halves (16 k pairs x 16 outputs x
// 2): all 16 rows of 64 bytes. In .rodata, so the compiler keeps it whole.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr TileConfig AMX_CONFIG = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// Whether this process may use the tiles: Linux hands out their 8 KiB of state only to a
// process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once; kernels since 5.16).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

// y[m, 0..32) (rows of stride N) = x[m, :] . panel for every m < M: x bfloat16 [M, K] with
// zero rows after M up to a multiple of AMX_BLOCK, panel [K/2, 32, 2] (K % 32 == 0).
void amx_panel_rows(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* panel, float* y, int64_t N) {
  _tile_loadconfig(&AMX_CONFIG);  // every call: another library's tiles may have run between
  alignas(64) float last[AMX_BLOCK * 32];  // a pass's sums where its rows run past M
  for (int64_t m = 0; m < M; m += AMX_BLOCK) {
    const uint16_t* x = xb + m * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, x + k, 2 * K);
      _tile_loadd(5, x + 16 * K + k, 2 * K);
      _tile_loadd(6, panel + 32 * k, 128);
      _tile_loadd(7, panel + 32 * k + 32, 128);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    const bool whole = m + AMX_BLOCK <= M;
    float* out = whole ? y + m * N : last;
    const int64_t ld = whole ? N : 32;
    _tile_stored(0, out, 4 * ld);
    _tile_stored(1, out + 16, 4 * ld);
    _tile_stored(2, out + 16 * ld, 4 * ld);
    _tile_stored(3, out + 16 * ld + 16, 4 * ld);
    if (!whole)
      for (int64_t r = 0; r < M - m; ++r) std::memcpy(y + (m + r) * N, last + r * 32, 32 * sizeof(float));
  }
  _tile_release();
}

#endif

// Fewest activation rows on AMX's tiles (0: none: a build without AMX-BF16, or a kernel that
// refused the tiles' state).
int64_t amx_rows() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted() ? AMX_ROWS : 0;
#else
  return 0;
#endif
}

// Whether M activation rows on bfloat16 panels multiply on AMX's tiles: the one test both the
// rows' bfloat16 copy (`bf16_rows_held`: padded for the tiles) and the product
// (`bf16_panel_rows`) read, so a copy is padded exactly where the tiles read past M.
bool on_tiles(int64_t M) {
  const int64_t from = amx_rows();
  return from > 0 && M >= from;
}

// Activation rows a bfloat16 copy of M rows holds: past M, zeros up to a whole pass of the
// tiles where they take M rows.
int64_t bf16_rows_held(int64_t M) {
  return on_tiles(M) ? (M + AMX_BLOCK - 1) / AMX_BLOCK * AMX_BLOCK : M;
}

}  // namespace
