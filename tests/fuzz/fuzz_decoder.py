"""atheris harness for the decoder's Python entry with its C steady state (lmqtt.gateway.mqtt
Decoder.feed over gateway/mqtt/_scan.c): arbitrary bytes, cut into pieces, fed to a decoder with
the C scan and to one without it (the reference); the two must return the same packets or raise
the same ProtocolError, and nothing else may escape. Run for a bounded time by
tests/fuzz/test_fuzz_harnesses.py; the long run's command and result are in BENCHMARKS.md.

    python3 tests/fuzz/fuzz_decoder.py -max_total_time=3600 [CORPUS_DIR]
"""
from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from lmqtt.gateway.mqtt import Decoder, ProtocolError, decoder as decoder_mod, encode, packets as P

SCAN = decoder_mod._scan
if SCAN is None:
    sys.exit("lmqtt.gateway.mqtt._scan is not built (or LMQTT_PURE_PYTHON is set): nothing to fuzz")


def _run(setup: int, pieces: list[bytes], scan):
    decoder_mod._scan = scan
    try:
        v5 = setup & 1
        server = bool(setup & 2)
        d = Decoder(None if server else (5 if v5 else 4), server_side=server, share_empty_properties=bool(setup & 16))
        out = []
        if server:
            d.feed(encode(P.Connect("fz", 5 if v5 else 4), 5 if v5 else 4))
        d.max_packet_size = (1 << 28, 300, 40, 5)[(setup >> 2) & 3]
        for piece in pieces:
            try:
                out.append(("ok", d.feed(piece)))
            except ProtocolError as e:
                out.append(("error", str(e), e.reason_code, e.packets))
                break
        return out, d.buffered
    finally:
        decoder_mod._scan = SCAN


def TestOneInput(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    setup = fdp.ConsumeInt(1)
    cuts = sorted(fdp.ConsumeIntInRange(0, 4096) for _ in range(fdp.ConsumeIntInRange(0, 4)))
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    cuts = [c % (len(body) + 1) for c in cuts]
    pieces = [body[a:b] for a, b in zip([0] + sorted(cuts), sorted(cuts) + [len(body)], strict=True)]
    got = _run(setup, pieces, SCAN)
    want = _run(setup, pieces, None)
    if got != want:
        raise AssertionError(f"C scan and reference differ on {data!r}:\n{got}\n{want}")


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
