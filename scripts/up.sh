#!/usr/bin/env bash
echo "./dev up: not built yet" >&2; exit 1
