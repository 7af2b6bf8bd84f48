"""``python -m autockpt``: the built-in demo (plan + measured result on a small GPT-2 or transformer)."""

from autockpt.demo import main

main()
