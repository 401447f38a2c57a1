"""A decode step's products alone: SmolLM2's 30 layers of int4 products at one
row, called in turn from C++ (no Python between them): row-major, lanes, and
lanes with the threads going through the pass together.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/stack_products.py [--rounds 5]

Random int4 weights of SmolLM2-135M's fused shapes (q/k/v 960x576, o
576x576, gate/up 3072x576, down 576x1536; 66 MB, twice the L3 cache), each
called once in order per pass, as ``decode_layers`` calls them:
``int4_linear_i16`` (row-major, ``Int4`` weights) and ``lanes_i16`` (the
same weights as ``Packed.lanes``), each product handed to the kernels'
threads (``Team::run``) as the layer ops are; and the lanes in one ``Gang``
(``decode_layers``' way: one hand-off a pass, each product split among the
threads, a barrier after it). Built from this tree's ``kernels.cpp`` with a
timing loop appended, under its own op namespace. Prints the best pass of
each per round, in turns, with the GB/s of the weights' bytes; and the read
probe of ``bench --roofline`` (summing 512 MiB). Needs a build with lanes
(AVX512-VNNI).
"""

from __future__ import annotations

import argparse
import time

import torch

from mstar.cpu.info import cpu_info
from mstar.cpu.quant.at_load import quantize_int4
from mstar.cpu.quant.kernels import SOURCE, build_under, kernel_or_why

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
PASSES = 10

TIMING = r"""
namespace {
// Microseconds a pass over `layers` (each as lanes, or as qweight, scales, mins) at one row;
// with `gang`, each pass by the threads together.
double passes_us(at::TensorList layers, bool lanes, bool gang, const at::Tensor& x576,
                 const at::Tensor& x1536, int64_t passes) {
  std::vector<float> y(4096);
  const int64_t step = lanes ? 1 : 3;
  auto pass = [&] {
    for (size_t i = 0; i < layers.size(); i += step) {
      const at::Tensor& w = layers[i];
      if (lanes) {
        const auto [N, K] = lanes_shape(w);
        multiply_lanes(w, N, K, (K == 576 ? x576 : x1536).data_ptr<float>(), 1, y.data());
      } else {
        const Int4 q = int4_weights(w, layers[i + 1], layers[i + 2]);
        linear_rows(q, (q.K == 576 ? x576 : x1536).data_ptr<float>(), 1, w.size(0), q.K, true, y.data());
      }
    }
  };
  const auto start = std::chrono::steady_clock::now();
  for (int64_t p = 0; p < passes; ++p) {
    if (gang) Gang::run(static_cast<int>(team_threads()), [&](int) { pass(); });
    else pass();
  }
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / passes;
}
}  // namespace
TORCH_LIBRARY_FRAGMENT(mstar_quant, m) {
  m.def("passes_us(Tensor[] layers, bool lanes, bool gang, Tensor x576, Tensor x1536, int passes) -> float",
        &passes_us);
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if (why := kernel_or_why()) is not None:
        raise SystemExit(f"the kernels do not run here: {why}")
    if not torch.ops.mstar_quant.lanes_rows():
        raise SystemExit("this build has no lanes (no AVX512-VNNI)")
    ops = build_under("mstar_quant_stack", SOURCE.read_text() + TIMING)
    torch.manual_seed(0)
    packed = [quantize_int4(torch.randn(n, k)) for _ in range(LAYERS) for n, k in SHAPES]
    row_major = [t for p in packed for t in (p.qweight, p.scales, p.mins)]
    lanes = [p.lanes() for p in packed]
    nbytes = sum(t.numel() * t.element_size() for t in row_major)
    x576, x1536 = torch.randn(1, 576), torch.randn(1, 1536)
    probe = torch.ones(128 << 20)
    print(f"CPU: {cpu_info().describe()}")
    print(f"{len(packed)} products at one row, {nbytes / 1e6:.1f} MB a pass")
    for r in range(args.rounds):
        times = {
            name: ops.passes_us(layers, layers is lanes, gang, x576, x1536, PASSES)
            for name, layers, gang in (
                ("row-major", row_major, False),
                ("lanes", lanes, False),
                ("lanes, gang", lanes, True),
            )
        }
        start = time.perf_counter()
        probe.sum()
        read = probe.numel() * 4 / (time.perf_counter() - start) / 1e9
        line = "  ".join(
            f"{n} {us / 1e3:.2f} ms ({nbytes / us / 1e3:.1f} GB/s)" for n, us in times.items()
        )
        print(f"round {r}: {line}  read probe {read:.1f} GB/s")


if __name__ == "__main__":
    main()
