#!/usr/bin/env bash
echo "./dev env: not built yet" >&2; exit 1
