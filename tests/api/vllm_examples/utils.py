# SPDX-License-Identifier: Apache-2.0
# Adapted from vLLM's examples/offline_inference/basic/utils.py (github.com/vllm-project/vllm at
# 21034aef), Apache License 2.0. Changed only: the imports (vllm -> spec_jax), each changed line
# ending with what it was.
from argparse import Namespace

from spec_jax import SamplingParams  # was: from vllm import SamplingParams
from spec_jax.utils import FlexibleArgumentParser  # was: from vllm.utils import FlexibleArgumentParser


def add_sampling_params_args(
        parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    sampling_params = SamplingParams()
    parser.add_argument("--max-tokens",
                        type=int,
                        default=sampling_params.max_tokens)
    parser.add_argument("--temperature",
                        type=float,
                        default=sampling_params.temperature)
    parser.add_argument("--top-p", type=float, default=sampling_params.top_p)
    parser.add_argument("--top-k", type=int, default=sampling_params.top_k)
    return parser


def del_sampling_params_args(args: Namespace) -> Namespace:
    del args.max_tokens
    del args.temperature
    del args.top_p
    del args.top_k
    return args
