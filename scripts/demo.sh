#!/usr/bin/env bash
# The main job: train a convnet on scikit-learn's digits with MirroredStrategy on 2 CPU replicas.
# Installs only what the demo needs (stratagem[demo]) unless .venv already has the developer set.
STRATAGEM_EXTRAS=demo source "$(dirname "$0")/_venv.sh"
exec stratagem demo "$@"
