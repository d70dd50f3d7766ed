"""Sample Factory's Atari example with ale-py's games registered in every process it starts: ``bench/pong.py
--peer`` runs it with the Python that has Sample Factory (not srl's).

Sample Factory 2.x needs gymnasium < 1.0, where ale-py (0.9, which ships the ROMs) registers its games only
once it is imported; Sample Factory's workers are spawned, so each imports this module again, and with it
ale_py. Arguments are Sample Factory's (``--env atari_pong --algo APPO ...``).
"""

import sys

import ale_py  # noqa: F401 - registers ALE/... and the NoFrameskip-v4 ids, here and in every spawned worker

if __name__ == "__main__":
    from sf_examples.atari.train_atari import main

    sys.exit(main())
