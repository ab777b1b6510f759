"""The attacker (``attacker.py``) as a process of its own, for a simulated host (test_hosts_attacked.py).

    python tests/multiprocess/attacker_main.py HOST:PORT ANSWER_HEX KIND=SOURCE ...

Runs each KIND of attack on the controller at HOST:PORT from the address SOURCE, one kind after the other,
in the order given (the test gives the few hundred connections last); ANSWER_HEX is a recorded handshake
``Answer`` line, for the replay. Prints one JSON line: per kind, the connections it opened, the challenges it
received and what the controller let through.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from attacker import Attacker

WORKERS = 3  # the ids the run's workers have: 0, 1, 2


def attacks(answer: bytes) -> dict[str, Callable[[Attacker], None]]:
    def existing_ids(attacker: Attacker) -> None:
        for worker in range(WORKERS):
            attacker.impostor_hello(worker)  # Hello as the first line
            attacker.guess_proof(worker)  # a made-up proof, then Hello

    def no_proof(attacker: Attacker) -> None:
        for worker in range(WORKERS):
            attacker.no_proof(worker)

    return {
        "garbage": lambda attacker: attacker.garbage(10),
        "10 MB line": lambda attacker: attacker.long_line(3),
        "no proof": no_proof,
        "replayed proof": lambda attacker: attacker.replay(answer, 0, 10),
        "existing id": existing_ids,
        "connections": lambda attacker: attacker.idle(300),
    }


def main(argv: list[str]) -> int:
    host, _, port = argv[0].rpartition(":")
    known = attacks(bytes.fromhex(argv[1]))
    report = {}
    for pair in argv[2:]:
        kind, _, source = pair.partition("=")
        attacker = Attacker(int(port), timeout_s=20.0, host=host, source=source)
        known[kind](attacker)
        report[kind] = {
            "connections": attacker.connections,
            "challenges": attacker.challenges,
            "problems": attacker.problems,
        }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
