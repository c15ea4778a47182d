#!/usr/bin/env bash
# Land a finished rebuild (issue 18) in examples/models: measure it, then replace the bundled levels.
#
#   examples/models/land_rebuild.sh            # model card of $REBUILD_DIR/family (unless --check
#                                              # measured these weights), then copy it here
#   examples/models/land_rebuild.sh --check    # the model card only (nothing here changes)
#
# Steps: (1) `cascade model-card $REBUILD_DIR/family` (its Targets table says which targets are met)
# into $REBUILD_DIR/card.{md,json}; (2) each level's files replace examples/models/LEVEL/ (weights,
# config, tokenizer, training.json), keeping the bundled chat_template.jinja; (3) measurements.md and
# metrics.json are the card. Then, by hand: the README tables, the tests that pin the family
# (tests/test_models.py) and the re-measurement (examples/reports/measure.sh). git shows the old
# family until you commit.
set -euo pipefail

cd "$(dirname "$0")/../.."
REBUILD_DIR=${REBUILD_DIR:-/work/family-rebuild}
FAMILY=$REBUILD_DIR/family
HERE=examples/models
LEVELS=(tiny small medium large)

for lv in "${LEVELS[@]}"; do
  [[ -f $FAMILY/$lv/config.json && -f $FAMILY/$lv/model.safetensors ]] || {
    echo "$FAMILY/$lv is not finished; examples/models/rebuild.sh status" >&2; exit 1; }
done

# the card of these weights: measured now, or by an earlier --check (newer than every level's weights)
fresh_card() {
  [[ -f $REBUILD_DIR/card.json && -f $REBUILD_DIR/card.md ]] || return 1
  for lv in "${LEVELS[@]}"; do [[ $REBUILD_DIR/card.json -nt $FAMILY/$lv/model.safetensors ]] || return 1; done
}
if [[ ${1:-} == --check ]] || ! fresh_card; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  python -c 'import sys; from cascade.cli import main; sys.exit(main())' model-card "$FAMILY" \
    --json "$REBUILD_DIR/card.json" --markdown "$REBUILD_DIR/card.md" --threads "$OMP_NUM_THREADS" \
    2>&1 | grep -a -v "Loading weights"
else
  echo "using the model card of $FAMILY measured by --check ($REBUILD_DIR/card.md)"
fi
[[ ${1:-} == --check ]] && exit 0

for lv in "${LEVELS[@]}"; do
  template=$(mktemp)
  cp "$HERE/$lv/chat_template.jinja" "$template"
  rm -rf "${HERE:?}/$lv"
  mkdir -p "$HERE/$lv"
  cp "$FAMILY/$lv"/{config.json,generation_config.json,model.safetensors,tokenizer.json,tokenizer_config.json,training.json} \
    "$HERE/$lv/"
  mv "$template" "$HERE/$lv/chat_template.jinja"
done
# the card's command names the rebuild directory; the bundled copy is measured here
as_here=(-e "s|$FAMILY|examples/models|g" -e "s|$REBUILD_DIR/card.json|$HERE/metrics.json|g"
         -e "s|$REBUILD_DIR/card.md|$HERE/measurements.md|g")
sed "${as_here[@]}" "$REBUILD_DIR/card.md" >"$HERE/measurements.md"
sed "${as_here[@]}" "$REBUILD_DIR/card.json" >"$HERE/metrics.json"
echo "landed: $(du -ch "$HERE"/*/model.safetensors | tail -1 | cut -f1) of weights; next: README tables," \
  "python -m pytest tests/test_models.py, examples/reports/measure.sh"
