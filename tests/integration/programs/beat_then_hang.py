"""Test program: beats through the heartbeat file protocol (touches $CLUSTER_HEARTBEAT_FILE,
as the reference trainer's lifecycle.Heartbeat does) every --every seconds for --for seconds,
then stops beating and sleeps forever, printing nothing more: a hang, for the watchdog.

    --every S  seconds between beats (default 0.5)
    --for S    seconds of beating (default 12)
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time


def touch(path: str) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        open(path, "a").close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--every", type=float, default=0.5)
    p.add_argument("--for", dest="duration", type=float, default=12.0)
    args = p.parse_args()
    path = os.environ["CLUSTER_HEARTBEAT_FILE"]
    print(f"beating every {args.every:g} s for {args.duration:g} s, then hanging", flush=True)
    end = time.monotonic() + args.duration
    while time.monotonic() < end:
        touch(path)
        time.sleep(args.every)
    threading.Event().wait()          # the hang: no beat, no output, until stopped
    return 0


if __name__ == "__main__":
    sys.exit(main())
