#!/usr/bin/env bash
# The main job: train a convnet on scikit-learn's digits with MirroredStrategy on 2 CPU replicas.
source "$(dirname "$0")/_venv.sh"
exec stratagem demo "$@"
