"""`spec-jax` command line. Flags are spelled like vLLM's (underscores or dashes).

    spec-jax generate --model DIR --prompt "def fib(n):" --max-tokens 64
    spec-jax generate --prompt-token-ids 1,2,3 --temperature 0.8 --seed 1
    spec-jax generate --model DIR --prompt "..." --speculative-config '{"method":"mtp","num_speculative_tokens":2}'
    spec-jax serve DIR --max-num-seqs 8 --port 8000 --api-key KEY
    spec-jax serve DIR --enable-auto-tool-choice --tool-call-parser qwen3_coder --reasoning-parser qwen3
    spec-jax bench --model DIR --input prompts.jsonl --speculative-config '{"method":"ngram"}'
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time

from spec_jax.api.arg_parser import FlexibleArgumentParser
from spec_jax.engine.config import MAMBA_SSM_CACHE_DTYPES
from spec_jax.engine.reasoning_grammar import REASONING_PARSERS
from spec_jax.api.tool_parsers import TOOL_CALL_PARSERS


# vLLM's engine-argument flags: passed to LLM when given (None: not given).
VLLM_FLAGS = {
    "gpu_memory_utilization": dict(type=float, help="size --max-num-seqs to this share of device memory beside the "
                                                    "weights"),
    "quantization": dict(help="'fp8': quantize the projections as they load"),
    "tensor_parallel_size": dict(type=int, help="devices to split the model over (default 1)"),
    "kv_cache_dtype": dict(help="auto"),
    "mamba_ssm_cache_dtype": dict(choices=MAMBA_SSM_CACHE_DTYPES,
                                  help="the dtype the GDN state is cached in (auto: the checkpoint's, float32)"),
    "enable_prefix_caching": dict(action=argparse.BooleanOptionalAction,
                                  help="resume prompts from cached prefix blocks, exact (default: on for serve, off "
                                       "for generate and bench)"),
    **{name: dict(action="store_true", help="accepted and ignored") for name in (
        "enforce_eager", "trust_remote_code", "enable_chunked_prefill", "disable_log_stats")},
    **{name: dict(type=int, help="accepted and ignored") for name in (
        "swap_space", "max_num_batched_tokens", "block_size")},
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory (HF safetensors) or a .gguf file; default: the embedded default model")
    p.add_argument("--dtype", default="auto", help="bfloat16, float32 or auto (bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion (default 4096)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="batch rows per step (default 8, or what --gpu-memory-utilization fits up to 256)")
    p.add_argument("--batch-buckets", type=integer_list, default=None, metavar="ROWS",
                   help="comma-separated batch row counts to compile for (default: powers of two up to "
                        "--max-num-seqs); a batch runs padded to the smallest that holds it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-config", default=None,
                   help="vLLM's speculative config as JSON, e.g. '{\"method\":\"ngram\",\"num_speculative_tokens\":3}'")
    p.add_argument("--rollback", default="replay", choices=["checkpoint", "replay"],
                   help="how GDN state returns to the accepted prefix after verification")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json, a directory holding one, or a cached repo id")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a token's logits bitwise the same in any pass: greedy speculation equals plain decoding")
    vllm = p.add_argument_group("vLLM engine arguments (spec_jax/api/engine_args.py says which are used)")
    for name, options in VLLM_FLAGS.items():
        vllm.add_argument("--" + name.replace("_", "-"), default=None, **options)


def build_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(prog="spec-jax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts")
    add_model_args(gen)
    gen.add_argument("--prompt", action="append", default=None, help="prompt text (repeat for a batch)")
    gen.add_argument("--prompt-token-ids", type=integer_list, action="append", default=None,
                     help="comma-separated token ids, instead of text (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="a string that ends a completion (repeat for several); the text ends before it")
    gen.add_argument("--stop-token-ids", type=integer_list, default=None, help="comma-separated extra stop token ids")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--compare", action="store_true",
                     help="also run the prompts with speculation off; print both speeds (compilation excluded), "
                          "the speedup and whether greedy output is identical")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the checkpoint, as vLLM's `vllm serve MODEL` takes it (or give --model)")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=port_number, default=8000)
    serve.add_argument("--timeout-graceful-shutdown", type=seconds, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, finish in-flight requests for at most this long, then stop (default 30)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template file, for checkpoints whose tokenizer_config.json has none")
    serve.add_argument("--steps-per-chunk", type=int, default=4,
                       help="decode steps per device call between streams, 1 to --max-model-len (default 4)")
    serve.add_argument("--api-key", default=None,
                       help="clients of the /v1 routes must send 'Authorization: Bearer KEY' (401 otherwise)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="read tool calls out of chat answers (tool_choice 'auto'); needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                       help="the tool-call format: qwen3_coder (Qwen3.5/3.6, Qwen3-Coder) or hermes (Qwen2.5/3)")
    serve.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="qwen3: the text inside <think>...</think> goes to reasoning_content, not content, "
                            "and structured output holds the answer after it")
    bench = sub.add_parser("bench", help="batch eval: a JSONL of prompts through the jitted engine, with metrics")
    add_model_args(bench)
    bench.add_argument("--input", required=True,
                       help='JSONL, one {"prompt": ...} or {"prompt_token_ids": [...]} a line')
    bench.add_argument("--output", default=None, help="per-request outputs (JSONL); default: INPUT.outputs.jsonl")
    bench.add_argument("--metrics", default=None, help="aggregate metrics (JSON); default: INPUT.metrics.json")
    bench.add_argument("--max-tokens", type=int, default=64, help="for lines that do not set max_tokens")
    bench.add_argument("--temperature", type=float, default=0.0, help="for lines that do not set temperature")
    bench.add_argument("--no-warmup", action="store_true", help="time compilation too (default: compile first)")
    conv = sub.add_parser("convert", help="save a checkpoint's converted parameters with Orbax for fast loading")
    conv.add_argument("--model", required=True, help="the HF safetensors checkpoint directory")
    conv.add_argument("--output", required=True, help="an empty or new directory")
    conv.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    conv.add_argument("--quantization", choices=("int8", "fp8", "fp8_block", "nvfp4"), default=None,
                      help="quantize the projection weights (weight-only; embeddings, lm_head, norms, routers stay)")
    return parser


def port_number(text: str) -> int:
    """--port: a TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def integer_list(text: str) -> list[int]:
    """A comma-separated list of integers (token ids, batch rows), checked as the flags are read."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def seconds(text: str) -> float:
    """A duration in seconds, >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0 seconds")
    return value


def load_llm(args, **options):
    """The LLM the command's flags describe; options: LLM keywords of one command's own flags."""
    from spec_jax.api.llm import LLM

    t0 = time.perf_counter()
    engine_args = {name: getattr(args, name) for name in VLLM_FLAGS if getattr(args, name) is not None}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, tokenizer=args.tokenizer,
              max_num_seqs=args.max_num_seqs, batch_buckets=args.batch_buckets, seed=args.seed,
              speculative_config=args.speculative_config, rollback=args.rollback,
              batch_invariant=args.batch_invariant, **engine_args, **options)
    print(f"loaded {llm.model_path} ({llm.cfg.model_type}, {llm.cfg.num_hidden_layers} layers) "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return llm


def generate(args) -> None:
    from spec_jax.api.llm import SamplingParams

    if not args.prompt and not args.prompt_token_ids:
        raise SystemExit("error: give --prompt TEXT or --prompt-token-ids IDS")
    if args.prompt and args.prompt_token_ids:
        raise SystemExit("error: give --prompt or --prompt-token-ids, not both")
    if args.model is None:
        from spec_jax.default_model import is_trained_default

        if not is_trained_default():
            print("NOTE: no --model given: using the embedded default model. Its weights are RANDOM, "
                  "so its text is noise; pass --model DIR for a real checkpoint.", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, stop=args.stop, stop_token_ids=args.stop_token_ids,
                            ignore_eos=args.ignore_eos)
    if args.compare and args.speculative_config is None:
        raise ValueError("--compare needs --speculative-config (it compares speculation on with off)")
    llm = load_llm(args)
    run = lambda model, bar=True: (model.generate(args.prompt, params, use_tqdm=bar) if args.prompt else  # noqa: E731
                                   model.generate(prompt_token_ids=args.prompt_token_ids,
                                                  sampling_params=params, use_tqdm=bar))
    outs = run(llm)
    for out in outs:
        c = out.outputs[0]
        m = out.metrics
        print(f"--- prompt: {out.prompt!r}" if out.prompt is not None else f"--- prompt ids: {out.prompt_token_ids}")
        print(c.text if llm.tokenizer else c.token_ids)
        if not args.compare:
            print(f"[{m['num_generated_tokens']} tokens, finish={c.finish_reason}, {m['tokens_per_s']:.1f} tok/s "
                  f"including compilation on first use]", file=sys.stderr)
    if llm.speculative_config is not None:
        print(f"[speculation {speculation_summary(llm)}]", file=sys.stderr)
    if args.compare:
        compare(llm, outs, run, greedy=params.temperature == 0)


def speculation_summary(llm) -> str:
    a, spec = llm.metrics, llm.speculative_config
    per_pos = ", ".join(f"{x:.2f}" for x in a["acceptance_per_position"])
    return (f"{spec.method} k={spec.num_speculative_tokens}: acceptance rate {a['acceptance_rate']:.2f}, mean "
            f"acceptance length {a['mean_acceptance_length']:.2f}, per position {per_pos}; "
            f"{a['num_accepted_tokens']}/{a['num_draft_tokens']} drafts accepted")


def compare(llm, outs, run, *, greedy: bool) -> None:
    """Speculation on against off on the same prompts: each timed on a second run, so compilation
    (done by the first) is excluded."""
    plain = llm.with_speculation(None)
    plain_outs = run(plain, False)
    speeds = {}
    for name, model in (("off", plain), ("on", llm)):
        run(model, False)
        speeds[name] = model.metrics["tokens_per_s"]
    same = [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain_outs]
    same_text = "identical" if same else "DIFFERENT"
    print(f"speculation off: {speeds['off']:.1f} tok/s\n"
          f"speculation on:  {speeds['on']:.1f} tok/s ({llm.speculative_config.method} "
          f"k={llm.speculative_config.num_speculative_tokens}, mean acceptance length "
          f"{llm.metrics['mean_acceptance_length']:.2f})\n"
          f"speedup {speeds['on'] / speeds['off']:.2f}x (compilation excluded: each timed on a second run); "
          + (f"greedy output {same_text} to speculation off's" if greedy else
             "sampled output: the same distribution, not the same tokens"))


def serve(args) -> None:
    import uvicorn

    from spec_jax.api.chat_requests import ChatParsers
    from spec_jax.api.server import Server, build_app

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice, as {args.model_tag!r} and as --model {args.model!r}")
    args.model = args.model_tag or args.model
    parsers = ChatParsers(tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                          reasoning_parser=args.reasoning_parser)  # checked before the model loads
    if args.enable_prefix_caching is None:  # on by default in the server, as in vLLM
        args.enable_prefix_caching = True
    llm = load_llm(args, reasoning_parser=args.reasoning_parser)  # grammars then start after the reasoning
    if not 1 <= args.steps_per_chunk <= llm.max_model_len:
        raise ValueError(f"--steps-per-chunk {args.steps_per_chunk} must be 1 to {llm.max_model_len} (the "
                         f"--max-model-len: no row runs more steps)")
    server = Server(llm, served_model_name=args.served_model_name, chat_template=args.chat_template,
                    steps_per_chunk=args.steps_per_chunk, parsers=parsers, api_key=args.api_key)
    print(f"serving {server.name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(build_app(server), host=args.host, port=args.port,
                timeout_graceful_shutdown=args.timeout_graceful_shutdown)


def bench(args) -> None:
    from spec_jax.api.batch_eval import output_paths, run_file

    output, metrics = output_paths(args.input, args.output, args.metrics)  # before the model loads
    run_file(load_llm(args), args.input, str(output), str(metrics), max_tokens=args.max_tokens,
             temperature=args.temperature, warmup=not args.no_warmup)


def convert(args) -> None:
    from spec_jax.writing.convert import convert as write

    t0 = time.perf_counter()
    out = write(args.model, args.output, args.dtype, args.quantization)
    print(f"converted {args.model} to {out} in {time.perf_counter() - t0:.1f}s; load it with --model {out}")


@contextlib.contextmanager
def exit_on_interrupt():
    """Within it, Ctrl-C ends the process at once with status 130 (128 + SIGINT). The main thread
    may wait in XLA for many seconds, and Python runs a signal handler only once it is back in the
    interpreter (then XLA's threads abort the exit), so a thread watching the signal's wakeup fd
    leaves for it, with os._exit. Nothing changes outside the main thread (which alone may set
    signal handlers) or in a process started with SIGINT ignored (a background job)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    handler = signal.signal(signal.SIGINT, lambda signum, frame: None)  # the watcher acts on it
    wakeup = signal.set_wakeup_fd(write)
    threading.Thread(target=exit_when_interrupted, args=(read,), daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGINT, handler)
        os.close(write)  # the watcher reads the end of the pipe and returns


def exit_when_interrupted(fd: int) -> None:
    """Read signal numbers from the wakeup fd until SIGINT (then exit 130) or its end."""
    while signals := os.read(fd, 64):
        if signal.SIGINT in signals:
            os.write(2, b"\ninterrupted\n")
            os._exit(130)
    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"generate": generate, "serve": serve, "bench": bench, "convert": convert}[args.command]
    try:
        with exit_on_interrupt() if args.command in ("generate", "bench") else contextlib.nullcontext():
            command(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file named on the command line cannot be read or written
        print(f"error: {e.strerror}: {e.filename!r}" if e.filename else f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
