"""What verifying gossip messages costs: sealing one message and verifying a round's received
messages, against the rest of a gossip round of the same size, side by side in one run.

    python bench/checksum.py [--sizes 1M,4M] [--bits 4] [--neighbours 2] [--repeat 7]

A gossip round of one member with K neighbours does, besides moving bytes: quantize its
difference (``quantize``), decode its own message into its fresh copy and, when the round is
applied, decode its own message plus the K received ones (two ``dequant_accumulate`` calls).
Integrity adds one seal (:func:`qcomm.collectives.gossip.integrity.seal_`) and one verification
of the K received messages (:func:`~qcomm.collectives.gossip.integrity.bad_messages`). The table
gives medians and the ratio; the target is below 3% at 4M floats on CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import (
    Timer,
    environment,
    format_size,
    format_table,
    parse_list,
    parse_size,
    print_environment,
    write_json,
)
from qcomm.collectives.gossip.integrity import SEAL_NBYTES, bad_messages, seal_
from qcomm.compress import QuantSpec, dequant_accumulate, packed_nbytes, quantize


def measure(numel: int, spec: QuantSpec, neighbours: int, timer: Timer) -> dict:
    """Median seconds of the round's codec work and of sealing + verifying, for one size."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    hat = torch.zeros(numel)
    mix = torch.zeros(numel)
    nbytes = packed_nbytes(numel, spec)
    messages = torch.empty(neighbours + 1, nbytes + SEAL_NBYTES, dtype=torch.uint8)
    quantize(x, spec, seed=1, out=messages[0, :nbytes])
    for k in range(neighbours + 1):  # realistic received bytes, each sealed by its sender
        messages[k, :nbytes] = messages[0, :nbytes]
        seal_(messages[k], 7, k)
    body = messages[:, :nbytes].contiguous()
    weights = [1.0 / (neighbours + 1)] * (neighbours + 1)
    senders = list(range(1, neighbours + 1))

    def codec_round() -> None:
        quantize(x, spec, seed=1, out=body[0])
        dequant_accumulate(body[0], hat, spec)
        dequant_accumulate(body[0], hat, spec)
        dequant_accumulate(body, mix, spec, weights)

    def integrity() -> None:
        seal_(messages[0], 7, 0)
        if bad_messages(messages[1:], 7, senders, numel, spec):
            raise AssertionError("a correctly sealed message failed verification")

    codec_s, codec_all = timer.median(codec_round)
    check_s, check_all = timer.median(integrity)
    return {"numel": numel, "bits": spec.bits, "neighbours": neighbours,
            "message_bytes": nbytes + SEAL_NBYTES, "codec_round_s": codec_s,
            "integrity_s": check_s, "ratio": check_s / codec_s,
            "codec_round_times_s": codec_all, "integrity_times_s": check_all}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Cost of sealing and verifying gossip messages against the codec work of "
                    "a gossip round of the same size (medians, side by side in one run).")
    ap.add_argument("--sizes", default="1M,4M",
                    help="comma list of floats per message, with K/M suffixes (default 1M,4M).")
    ap.add_argument("--bits", type=int, default=4, help="code width (default 4).")
    ap.add_argument("--neighbours", type=int, default=2,
                    help="received messages per round (ring: 2; default 2).")
    ap.add_argument("--repeat", type=int, default=7, help="timed calls per cell (default 7).")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1, as one rank of several on a node).")
    ap.add_argument("--out", default="",
                    help="JSON output path (default bench/out/checksum.json).")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    env = environment(device)
    print_environment(env)
    spec = QuantSpec(args.bits, 128, "stochastic")
    timer = Timer(device, repeat=args.repeat, warmup=2)
    rows = [measure(n, spec, args.neighbours, timer)
            for n in parse_list(args.sizes, parse_size, "sizes")]
    print(format_table(
        ["floats", "bits", "received", "codec round ms", "seal+verify ms", "ratio"],
        [[format_size(r["numel"]), r["bits"], r["neighbours"], 1e3 * r["codec_round_s"],
          1e3 * r["integrity_s"], f"{100 * r['ratio']:.2f}%"] for r in rows]))
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "out" / "checksum.json"
    write_json(out, {"environment": env, "rows": rows})
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
