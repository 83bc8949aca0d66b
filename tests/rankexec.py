"""``python tests/rankexec.py CMD...``: exec CMD with this rank's stdout and
stderr sent to ``$HPCCOMM_TEST_LOGDIR/$HPCCOMM_TEST_LABEL-rank<R>.log`` when the
rank is not 0 (the rank comes from the launcher's environment), so that the
console shows rank 0's report only."""
import os
import sys


def rank_from_env():
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def main():
    rank = rank_from_env()
    logdir = os.environ.get("HPCCOMM_TEST_LOGDIR")
    if logdir and rank > 0:
        os.makedirs(logdir, exist_ok=True)
        label = os.environ.get("HPCCOMM_TEST_LABEL", "run")
        fd = os.open(os.path.join(logdir, f"{label}-rank{rank}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.execv(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
