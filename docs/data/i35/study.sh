#!/bin/bash
# The accuracy study of docs/results/accuracy.md ("Protocols (a) and (b)"),
# run again for the compressed-Adam work: the 2026-11-24 study's script
# (docs/data/i18/study.sh: learning-rate grids on validation, seed 100, written
# to the package's table hpccomm/bench/lr_chosen.json, then protocols (b) and
# (a) with seeds 0,1,2 and the negative control; P = 4 on one host) into this
# folder, then the tables.  Run from the repository root.
# The recorded run (commit 0be756f) wrote its grid into a copy of the table
# (--table / --lr-table on a scratch path), then copied into the package.
# The transformer's compressed-Adam rows: ../onebit-adam/run.sh; the CNN at
# 1x, 2x, 4x length and its recipes: ../cnn-length/run.sh.
set -e
export OUT=${OUT:-docs/data/i35}
./docs/data/i18/study.sh
python docs/study_tables.py $OUT > $OUT/tables.md
