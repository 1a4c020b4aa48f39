"""The flags of ``pdserve up``, ``controller`` and ``router``, and the config fields they set.

Lifecycle: ``add_serve_commands(sub)`` adds the three subcommands to ``pdserve``'s parser
(``cluster.cli``); once the command line is parsed and checked (``cluster.up_checks``), the
commands (``cluster.serve_cli``) turn the flags into config fields with ``pool_config_kwargs``
(``ClusterConfig``), ``engine_overrides`` (``EngineConfig``), ``router_overrides``
(``RouterConfig``) and ``sla_config`` (``--planner sla``). Functions of an ``argparse`` parser or
namespace only: nothing starts here, and nothing heavy is imported before a command needs it.
"""
from __future__ import annotations

import argparse
import json
import math
import os

from cluster.up_secrets import CLUSTER_SECRET_ENV, REDIS_URL_ENV
from transport.client_auth import API_KEY_ENV


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --served-model-name, --max-model-len."""
    p.add_argument("--model", default="tiny", help="tiny | bench | path to a Hugging Face model dir (default tiny)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context length of one request, prompt and output together: the workers' engines and the "
                        "router's checks (a longer prompt is refused by name, a chat without max_tokens may take "
                        "the rest); at most the model's max_position_embeddings (default: that)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name to clients (/v1/models, ModelInfo, the requests' model field) and in "
                        "metric labels (default: the built-in name or the model directory's basename)")


def add_pool_args(p: argparse.ArgumentParser) -> None:
    """The worker pools: sizes, planner bounds, engine knobs, supervisor, device."""
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters every worker serves beside the base model (PEFT directories: "
                        "adapter_config.json and adapter_model.safetensors, present on every node); a request picks "
                        "one by its model field (OpenAI's model, GenerateRequest.model); CPU workers (any "
                        "tensor-parallel size)")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default 1)")
    p.add_argument("--colocated", type=int, default=0, metavar="K",
                   help="run K colocated workers instead of prefill/decode pools (the baseline)")
    p.add_argument("--autoscale", action="store_true",
                   help="run the planner: each pool scales between its start size and --max-prefill/--max-decode")
    p.add_argument("--max-prefill", type=int, default=4, help="most prefill workers with --autoscale (default 4)")
    p.add_argument("--max-decode", type=int, default=4, help="most decode workers with --autoscale (default 4)")
    p.add_argument("--planner-interval", type=float, default=5.0, metavar="S",
                   help="seconds between the planner's decisions with --autoscale (default 5)")
    p.add_argument("--planner-cooldown", type=float, default=30.0, metavar="S",
                   help="seconds a pool waits after a change before the planner changes it again (default 30)")
    p.add_argument("--planner", choices=("threshold", "sla"), default="threshold",
                   help="the --autoscale policy: threshold = one worker at a time on queued prompt tokens and KV "
                        "usage; sla = each pool sized for the SLOs from the observed request rate and lengths "
                        "with --profile's step model (needs --ttft-slo-ms, --tpot-slo-ms, --profile; default "
                        "threshold)")
    p.add_argument("--ttft-slo-ms", type=float, default=None, metavar="MS",
                   help="--planner sla: time-to-first-token SLO (90th percentile) the pools are sized for")
    p.add_argument("--tpot-slo-ms", type=float, default=None, metavar="MS",
                   help="--planner sla: time-per-output-token SLO the pools are sized for")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="--planner sla: profile.json of this model on this hardware (`pdserve profile`)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs (and torch threads) per worker")
    p.add_argument("--gpus-per-worker", type=float, default=1.0, metavar="G",
                   help="Ray GPUs per worker with --device cuda, in (0, 1]: 0.5 puts one prefill and one decode "
                        "worker on one GPU, their KV over CUDA IPC (each worker's cache is --num-kv-blocks, or "
                        "256 MiB: both must fit) (default 1)")
    p.add_argument("--engine-process", action="store_true",
                   help="each worker runs its engine core in a process of its own, so engine steps do not share "
                        "a GIL with the worker's gRPC and streaming threads (vLLM v1's split; the worker then uses "
                        "about one core beyond --cpus-per-worker); prefill and decode workers: CPU only, their KV "
                        "cache in shared memory")
    p.add_argument("--no-kv-shm", dest="kv_shm", action="store_false",
                   help="workers on one host move KV through the loopback socket, not shared memory (the default "
                        "where both see one /dev/shm; gloo only)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the engines run: cuda gives every worker actor one Ray GPU and moves KV over "
                        "NCCL; auto = cuda when the Ray cluster offers GPUs, else cpu (default auto)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="each worker's engine split over N rank processes on its node (Megatron-style tensor "
                        "parallelism over gloo; the actor reserves N x --cpus-per-worker CPUs, each rank computes "
                        "with --cpus-per-worker threads); --prefill-tp / --decode-tp set a pool apart, and KV "
                        "moves between any two sizes, head by head (default 1)")
    p.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                   help="ranks of each prefill worker (default --tensor-parallel-size)")
    p.add_argument("--decode-tp", type=int, default=None, metavar="N",
                   help="ranks of each decode worker (default --tensor-parallel-size)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights, activations and KV cache of every worker: auto = float32 on CPU (what pdserve's "
                        "CPU kernels are built for), bfloat16 on CUDA (float16 on a GPU without bfloat16); "
                        "default auto")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, metavar="BYTES",
                   help="memory of each worker's KV cache (per rank), which sets its blocks unless --num-kv-blocks "
                        "does (default 256 MiB); on a GPU the decode graphs' memory comes out of it")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker (default: by memory)")
    p.add_argument("--prefill-num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV blocks of each prefill worker (default --num-kv-blocks)")
    p.add_argument("--decode-num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV blocks of each decode worker (default --num-kv-blocks; pools at different TP hold "
                        "different blocks in the same memory: `pdserve plan` recommends both)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="running sequences per decode worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="every engine's per-step token budget: prompts longer than N are prefilled in chunks "
                        "(chunked prefill), mixed with decodes (default 2048; `pdserve plan` recommends one)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn off the engines' automatic prefix caching (on by default)")
    p.add_argument("--quantization", choices=("int8", "int4", "w8a8", "w4a8", "fp8"), default=None,  # engine.quant.QUANTIZATIONS
                   help="quantization of every worker's model at load: int8 per output channel, int4 group-wise "
                        "(weight-only), or w8a8 / w4a8 (the same weights, activations rounded to int8 per 32 "
                        "values: integer dot products), or fp8 (float8 e4m3 weights and activations, scaled per "
                        "channel and per row: Hopper's FP8 GEMM; GPUs of compute capability 8.9+); default: off")
    p.add_argument("--quantization-group-size", type=int, default=128, metavar="G",
                   help="inputs per int4 scale, a multiple of 32 (default 128)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8"), default="auto",
                   help="KV cache of every worker: auto = the model dtype, int8 = quantized with per-token, "
                        "per-head scales (about 4x the tokens of float32 in the same memory, and a quarter of "
                        "the bytes shipped from prefill to decode), fp8 = float8 e4m3 (GPUs of compute capability "
                        "8.9+; 2x the tokens of bf16); default auto")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs: every decode step runs eagerly (by default a CUDA worker of one "
                        "rank replays its pure decode steps from graphs captured at start, one per batch bucket)")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes with a CUDA graph of their own, the largest at least --max-num-seqs "
                        "(default 1 2 4 8 16 24 ... up to --max-num-seqs)")
    p.add_argument("--cuda-graph-token-sizes", type=int, nargs="*", default=None, metavar="N",
                   help="token counts with piecewise CUDA graphs of their own: a step with a prefill chunk of up to "
                        "the largest replays everything but attention from graphs (default 8 16 32 64 96 128 192 "
                        "256 384 512, up to --max-num-batched-tokens; the flag alone turns them off)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="decode and colocated workers on CUDA schedule and launch each step while the one before "
                        "it still runs on the GPU, so the host's per-step work overlaps it (vLLM's async "
                        "scheduling; needs --device cuda, not with speculative decoding; off by default: not yet "
                        "timed on a GPU)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens do not depend on what else is batched with it or how its prompt was "
                        "chunked (on CUDA: pdserve's fixed-tile Triton GEMM and attention; float weights and KV "
                        "only); on CPU the default kernels already are")
    p.add_argument("--speculative-method", choices=("ngram", "draft_model"), default=None,
                   help="speculative decoding in the decode (and colocated) workers: ngram = prompt-lookup drafts, "
                        "draft_model = a small model's drafts (--speculative-model); drafts are verified in the "
                        "same forward, greedy and seeded output is unchanged (default: off)")
    p.add_argument("--speculative-model", default=None, metavar="MODEL",
                   help="the draft model (a built-in name such as tiny-draft, or a HF directory sharing the "
                        "target's tokenizer); implies --speculative-method draft_model")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="draft tokens per step with --speculative-method or --speculative-model (default 4)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, metavar="N",
                   help="shortest n-gram the ngram drafts look up (default 1)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N",
                   help="longest n-gram the ngram drafts look up (default 4)")
    p.add_argument("--check-interval", type=float, default=1.0, metavar="S",
                   help="seconds between the supervisor's health checks of the workers; a dead or stuck "
                        "worker is replaced under a new id (default 1)")


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object (argparse reports the ValueError as a usage error naming the flag)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def add_router_args(p: argparse.ArgumentParser) -> None:
    """The public front end: ports, admission, conditional disaggregation, TLS and API keys."""
    p.add_argument("--port", type=int, default=50051, help="router port, 0 = free port (default 50051)")
    p.add_argument("--http-port", type=int, default=8000, metavar="PORT",
                   help="OpenAI-compatible HTTP API port on --host (default 8000; 0 turns it off)")
    p.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json"),  # router.openai.tool_parsers
                   help="how the HTTP API reads tool calls out of a free answer (tool_choice auto), vLLM's names: "
                        "hermes (Hermes/Qwen <tool_call>) or llama3_json (default: none; tool_choice required or "
                        "a named function work without it)")
    p.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1", "qwen3"),  # router.openai.reasoning
                   help="split a thinking model's chat answers into reasoning and content, vLLM's names: "
                        "deepseek_r1 (DeepSeek-R1, QwQ) or qwen3; structured outputs then constrain the answer "
                        "after the reasoning, and requests may set thinking_token_budget (default: none)")
    p.add_argument("--default-chat-template-kwargs", default=None, type=_json_object, metavar="JSON",
                   help="extra chat template variables for every request, as a JSON object (e.g. "
                        "'{\"enable_thinking\": false}'); a request's chat_template_kwargs override them")
    p.add_argument("--health-port", type=int, default=0, metavar="PORT",
                   help="a plaintext gRPC port on --host offering only grpc.health.v1, for probes that speak no "
                        "TLS (the kubelet's) when the API serves TLS (default 0: none)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and gRPC LoadLoRAAdapter / "
                        "UnloadLoRAAdapter): LoRA adapters loaded on every worker while the cluster runs, from a "
                        "path on the workers' hosts (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; off by default)")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="with --allow-runtime-lora-updating: at most N adapters loaded at run time; a load beyond it "
                        "then unloads the least recently used idle one (default: no bound)")
    p.add_argument("--lora-resolver-dir", default=None, metavar="DIR",
                   help="with --allow-runtime-lora-updating: a request whose model names no served adapter first "
                        "loads DIR/<model> on every worker (vLLM's filesystem LoRA resolver); DIR absolute, on the "
                        "workers' hosts")
    p.add_argument("--allow-prefix-cache-reset", action="store_true",
                   help="serve vLLM's POST /reset_prefix_cache (every worker forgets its cached prompt blocks; for "
                        "cold-cache benchmarks and after weight changes); off: 404, as vLLM outside its dev mode")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="vLLM's: fcfs (default; a request's non-zero priority is refused) or priority (lower "
                        "priority values are served first and preempted last, in the router's queue and on every "
                        "worker)")
    p.add_argument("--responses-store-ttl-s", type=float, default=0.0, metavar="S",
                   help="keep finished /v1/responses answers S seconds in the cluster's Redis, so a request can "
                        "continue one (previous_response_id) and GET/DELETE /v1/responses/{id} find it (default "
                        "0: off, as vLLM's; each kept response holds its whole conversation)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0, metavar="N",
                   help="conditional disaggregation: prompts of at most N tokens are prefilled on the decode "
                        "worker itself (default 0: always use the prefill pool)")
    p.add_argument("--prefill-queue-max-tokens", type=int, default=None, metavar="N",
                   help="conditional disaggregation: prefill on the decode worker when every prefill worker has "
                        ">= N prompt tokens queued (default: never)")
    p.add_argument("--max-num-requests", type=int, default=None, metavar="N",
                   help="requests the router holds at once (running + queued); past it a request gets "
                        "RESOURCE_EXHAUSTED at once (router default 192; must stay below its 256 RPC threads)")
    p.add_argument("--stream-stall-timeout-s", type=float, default=60.0, metavar="S",
                   help="cut off a streaming client that has not read a response message for S seconds (gRPC: "
                        "stream reset, CANCELLED; HTTP: connection closed); its request is cancelled on the "
                        "workers. 0: never (default 60)")
    p.add_argument("--no-output-streams", dest="output_streams", action="store_false",
                   help="stream each request's tokens from its worker on its own call, a message per token, instead "
                        "of one stream per worker with a message per engine step (for comparison; default: streams)")
    p.add_argument("--one-loop", dest="one_loop", action="store_true",
                   help="run the HTTP API on the gRPC API's event loop and read the workers' output streams there, "
                        "instead of an HTTP loop thread and a reader thread per worker (docs/router_concurrency.md; "
                        "default: off)")
    kv = p.add_argument_group("cache-aware routing", "Prefill/colocated workers are scored as overlap x cached "
                              "prompt blocks - load x queued prompt blocks - request x requests, on the index the "
                              "workers' KV events build in every router (docs/interfaces.md)")
    kv.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                    help="ignore the workers' KV events: each router routes on its own mirror of what it sent where")
    kv.add_argument("--kv-overlap-weight", type=float, default=None, metavar="W", help="per cached block (default 1)")
    kv.add_argument("--kv-load-weight", type=float, default=None, metavar="W",
                    help="per block of queued prompt tokens (default 1)")
    kv.add_argument("--kv-request-weight", type=float, default=None, metavar="W",
                    help="per running/waiting/in-flight request, in blocks (default 2)")
    kv.add_argument("--kv-tie-blocks", type=float, default=None, metavar="B",
                    help="scores within B blocks of the best are drawn at random (no herding; default 1, 0 = off)")
    kv.add_argument("--kv-pending-s", type=float, default=None, metavar="S",
                    help="a placed prompt's blocks count as pending on its worker (held, and queued prefill work) "
                         "for S seconds or until its KV events confirm them (default 2, 0 = the events alone)")
    kv.add_argument("--no-kv-delta-transfers", dest="kv_delta_transfers", action="store_false",
                    help="ship every prompt's whole KV, even the blocks the decode worker already holds from the "
                         "conversation's earlier turns (default: only what it lacks)")
    kv.add_argument("--kv-prefix-fetch-min-tokens", type=int, default=None, metavar="N",
                    help="when the decode worker holds at least N more of a prompt's leading tokens than the prefill "
                         "worker, the prefill worker receives them from it instead of computing them "
                         "(while its measurements say receiving them is faster; default 64, 0 = never)")
    kv.add_argument("--no-decode-prefix-routing", dest="decode_prefix_routing", action="store_false",
                    help="pick decode workers by load alone, not by the conversation history they hold")
    kv.add_argument("--no-kv-replica-sync", dest="kv_replica_sync", action="store_false",
                    help="do not share placements between routers ({ns}:kvplace) nor break cold ties through Redis "
                         "({ns}:kvties): each router counts only its own pending placements and draws alone")
    sec = p.add_argument_group("public API security", "Secrets are read from files or the environment, never "
                                                      "printed; see docs/security.md.")
    sec.add_argument("--ssl-certfile", default=None, metavar="FILE",
                     help="PEM certificate chain: serve the public gRPC API over TLS (with --ssl-keyfile)")
    sec.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="PEM private key of --ssl-certfile")
    sec.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                     help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    sec.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help=f"require 'authorization: Bearer KEY' on the public API (repeatable). Visible in ps: "
                          f"prefer ${API_KEY_ENV} (comma-separated keys)")
    sec.add_argument("--api-keys-file", default=None, metavar="FILE",
                     help="TOML file of named API keys with per-key limits (requests_per_s, tokens_per_min, "
                          "max_concurrent), re-read when it changes (docs/security.md)")
    sec.add_argument("--quota-routers", type=int, default=1, metavar="N",
                     help="router replicas sharing the per-key limits: each enforces 1/N (default 1)")


def add_cluster_args(p: argparse.ArgumentParser, *, ray: bool = True, split: bool = False) -> None:
    """Where the cluster lives: interface, Redis, Ray, namespace, the cluster secret, logging.

    ``split``: a controller or router of a deployment, where Redis, the namespace and the secret are given,
    never made up (every process of the deployment must agree on them)."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address every listener binds: router gRPC and metrics, the embedded Redis and, on a "
                        "local Ray, the workers' gRPC, metrics and gloo (default 127.0.0.1; multi-node: this "
                        "node's own address; a wildcard such as 0.0.0.0 only when given here)")
    p.add_argument("--redis-url", default=None,
                   help=f"{'the deployment' if split else 'external'} Redis, redis://:PASSWORD@host:port/db or "
                        f"rediss:// for TLS (default: ${REDIS_URL_ENV}"
                        + ("; required" if split else ", else a private embedded one with a generated password")
                        + f"); a password on argv is visible in ps: prefer ${REDIS_URL_ENV}")
    if ray:
        p.add_argument("--address", default=None, required=split,
                       help="Ray cluster to join, e.g. auto or ray://head:10001"
                            + ("" if split else " (default: start a private local Ray)"))
    p.add_argument("--namespace", default=None, required=split,
                   help="the deployment: registry namespace" + (" and Ray namespace of its workers" if split
                                                                else " (default: a unique one)"))
    p.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                   help=f"file holding the secret the router presents to the workers (or ${CLUSTER_SECRET_ENV}; "
                        + ("required: every controller and router of the deployment must share it)" if split else
                           "default: a fresh one per run). Give the same one to every launcher of one cluster"))
    if not split:
        p.add_argument("--cluster-tls", action="store_true",
                       help="mutual TLS on the cluster plane (router -> workers) with a CA and certificate made "
                            "for this run; or give --cluster-ca/--cluster-cert/--cluster-key")
    p.add_argument("--cluster-ca", default=None, metavar="FILE",
                   help="PEM CA bundle of the cluster plane's mutual TLS (with --cluster-cert, --cluster-key; the "
                        "certificate must name DNS:pdserve-cluster.internal); docs/security.md")
    p.add_argument("--cluster-cert", default=None, metavar="FILE", help="PEM certificate every member presents")
    p.add_argument("--cluster-key", default=None, metavar="FILE", help="PEM key of --cluster-cert")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="HOST:PORT",
                   help="OpenTelemetry: export every request's trace (the router's span and its phases, continued on "
                        "each worker it crossed; a client's W3C traceparent is continued) to this OTLP/gRPC "
                        "collector, e.g. localhost:4317 (needs the otel extra; default: no tracing)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for SERVING")
    p.add_argument("--log-level", default="WARNING", help="Python log level (default WARNING)")


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    """The ``up``, ``controller`` and ``router`` subcommands."""
    p = sub.add_parser("up", help="run a cluster until SIGINT/SIGTERM",
                       description="Start Redis (unless --redis-url), Ray (unless --address), prefill and decode "
                                   "worker actors and the router; stop all of it on SIGINT/SIGTERM.")
    add_model_args(p)
    add_pool_args(p)
    add_router_args(p)
    add_cluster_args(p)
    p = sub.add_parser("controller", help="own a deployment's worker pools (workers outlive it)",
                       description="Take the deployment's controller lease, adopt its live detached workers, start "
                                   "the missing ones, and keep the pools at size (supervisor, --autoscale "
                                   "planner). On SIGINT/SIGTERM the workers keep serving; `pdserve down "
                                   "--address` stops them.")
    add_model_args(p)
    add_pool_args(p)
    add_cluster_args(p, split=True)
    p = sub.add_parser("router", help="a stateless router of a deployment (no Ray)",
                       description="Serve the public gRPC (and HTTP) API for the workers a controller keeps in "
                                   "the deployment's registry. Any number can run; each drains on SIGTERM "
                                   "without touching a worker.")
    add_model_args(p)
    p.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated",
                   help="route to prefill+decode pools or to colocated workers (default disaggregated)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM: NOT_SERVING at once, then up to S seconds for in-flight requests (default 30)")
    add_router_args(p)
    add_cluster_args(p, ray=False, split=True)


# ---- flags -> config fields ----------------------------------------------------------------------------
def pool_config_kwargs(args: argparse.Namespace) -> dict:
    if args.colocated:  # one mode per router: colocated replaces the two pools
        args.prefill = args.decode = 0
    return dict(model=args.model, served_model_name=args.served_model_name, num_prefill=args.prefill,
                num_decode=args.decode, num_colocated=args.colocated, host=args.host, ray_address=args.address,
                namespace=args.namespace, cpus_per_worker=args.cpus_per_worker, device=args.device,
                gpus_per_worker=getattr(args, "gpus_per_worker", 1.0),
                engine_overrides=engine_overrides(args), engine_process=args.engine_process,
                kv_shm=getattr(args, "kv_shm", True),
                pool_tensor_parallel={role: n for role, n in (("prefill", args.prefill_tp),
                                                              ("decode", args.decode_tp)) if n is not None},
                pool_num_kv_blocks={role: n for role, n in (("prefill", args.prefill_num_kv_blocks),
                                                            ("decode", args.decode_num_kv_blocks)) if n is not None},
                otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None))


def engine_overrides(args: argparse.Namespace, checked_only: bool = False) -> dict:
    """The EngineConfig fields the pool flags set."""
    out = {k: v for k, v in (("num_kv_blocks", args.num_kv_blocks), ("max_num_seqs", args.max_num_seqs),
                             ("max_num_batched_tokens", args.max_num_batched_tokens),
                             ("max_model_len", getattr(args, "max_model_len", None)),
                             ("kv_cache_memory_bytes", getattr(args, "kv_cache_memory_bytes", None)))
           if v is not None}
    if getattr(args, "lora_modules", None):  # (absolute: a Ray worker's working directory is not this one)
        from engine.lora import parse_lora_modules

        out["lora_modules"] = {n: os.path.abspath(p) for n, p in parse_lora_modules(args.lora_modules).items()}
    if getattr(args, "dtype", "auto") != "auto":  # auto: by the device, once it is known (cluster.config)
        out["dtype"] = args.dtype
    if args.no_prefix_caching and not checked_only:
        out["enable_prefix_caching"] = False
    if args.quantization is not None:
        out["quantization"] = args.quantization
        out["quantization_group_size"] = args.quantization_group_size
    if args.kv_cache_dtype != "auto":
        out["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tensor_parallel_size != 1:
        out["tensor_parallel_size"] = args.tensor_parallel_size
    if getattr(args, "enforce_eager", False):
        out["enforce_eager"] = True
    if getattr(args, "batch_invariant", False):
        out["batch_invariant"] = True
    if getattr(args, "async_scheduling", False):
        out["async_scheduling"] = True
    if getattr(args, "cuda_graph_sizes", None) is not None:
        out["cuda_graph_sizes"] = list(args.cuda_graph_sizes)
    if getattr(args, "cuda_graph_token_sizes", None) is not None:
        out["cuda_graph_token_sizes"] = list(args.cuda_graph_token_sizes)
    method = args.speculative_method or ("draft_model" if args.speculative_model else None)
    if method == "ngram":
        out["speculative_config"] = {"method": method, "num_speculative_tokens": args.num_speculative_tokens,
                                     "prompt_lookup_min": args.prompt_lookup_min,
                                     "prompt_lookup_max": args.prompt_lookup_max}
        if args.speculative_model:
            out["speculative_config"]["model"] = args.speculative_model  # refused by the config, by name
    elif method == "draft_model":
        out["speculative_config"] = {"method": method, "num_speculative_tokens": args.num_speculative_tokens,
                                     "model": args.speculative_model}
    return out


def router_overrides(args: argparse.Namespace) -> dict:
    """The RouterConfig fields the router flags set."""
    out = {"local_prefill_max_tokens": args.local_prefill_max_tokens,
           "prefill_queue_max_tokens": args.prefill_queue_max_tokens}
    if args.max_num_requests is not None:
        out["max_num_requests"] = args.max_num_requests
    if getattr(args, "max_model_len", None) is not None:  # the workers' context, so the router refuses by name
        out["max_context_length"] = args.max_model_len
    out["http_port"] = args.http_port or None  # 0: no HTTP API
    out["health_port"] = args.health_port or None
    if args.tool_call_parser is not None:
        out["tool_call_parser"] = args.tool_call_parser
    if getattr(args, "reasoning_parser", None) is not None:
        out["reasoning_parser"] = args.reasoning_parser
    if getattr(args, "default_chat_template_kwargs", None) is not None:
        out["default_chat_template_kwargs"] = args.default_chat_template_kwargs
    if getattr(args, "api_keys_file", None):
        out["api_keys_file"] = args.api_keys_file
    stall = getattr(args, "stream_stall_timeout_s", 60.0)
    if stall < 0:
        raise ValueError(f"--stream-stall-timeout-s must be >= 0 (0: never), got {stall:g}")
    out["stream_stall_timeout_s"] = stall or None
    if getattr(args, "quota_routers", 1) != 1:
        out["quota_routers"] = args.quota_routers
    if not getattr(args, "output_streams", True):
        out["output_streams"] = False
    if not getattr(args, "kv_events", True):
        out["kv_events"] = False
    if getattr(args, "one_loop", False):
        out["one_loop"] = True
    if getattr(args, "allow_runtime_lora_updating", False):
        out["allow_runtime_lora_updating"] = True
    if getattr(args, "max_loras", None) is not None:
        if not out.get("allow_runtime_lora_updating"):
            raise ValueError("--max-loras needs --allow-runtime-lora-updating (it bounds the adapters loaded at run "
                             "time)")
        if args.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {args.max_loras}")
        out["max_loras"] = args.max_loras
    resolver = getattr(args, "lora_resolver_dir", None)
    if resolver is not None:
        if not out.get("allow_runtime_lora_updating"):
            raise ValueError("--lora-resolver-dir needs --allow-runtime-lora-updating (it loads adapters at run time)")
        if not os.path.isabs(resolver):
            raise ValueError(f"--lora-resolver-dir must be an absolute path (the workers read it), got {resolver!r}")
        out["lora_resolver_dir"] = resolver
    if getattr(args, "allow_prefix_cache_reset", False):
        out["allow_prefix_cache_reset"] = True
    if getattr(args, "scheduling_policy", "fcfs") != "fcfs":
        out["scheduling_policy"] = args.scheduling_policy
    store_ttl = getattr(args, "responses_store_ttl_s", 0.0)
    if not math.isfinite(store_ttl) or store_ttl < 0:
        raise ValueError(f"--responses-store-ttl-s must be a finite number of seconds >= 0 (0: off), got {store_ttl:g}")
    if store_ttl:
        out["responses_store_ttl_s"] = store_ttl
    if getattr(args, "otlp_traces_endpoint", None):
        out["otlp_traces_endpoint"] = args.otlp_traces_endpoint
    for name in ("kv_replica_sync", "kv_delta_transfers", "decode_prefix_routing"):
        if not getattr(args, name, True):
            out[name] = False
    for name in ("kv_overlap_weight", "kv_load_weight", "kv_request_weight", "kv_tie_blocks", "kv_pending_s",
                 "kv_prefix_fetch_min_tokens"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    return out


def sla_config(args: argparse.Namespace):
    """The ``SlaConfig`` of --planner sla (flags checked by ``check_sla_args``)."""
    from cluster.sla_planner import SlaConfig
    from engine.config import EngineConfig

    prof, eng = args.sla_profile, EngineConfig
    blocks = args.num_kv_blocks
    kv_tokens = (blocks * prof.block_size if blocks is not None
                 else (getattr(args, "kv_cache_memory_bytes", None) or EngineConfig.kv_cache_memory_bytes)
                 // prof.kv_bytes_per_token)
    link = "nccl" if args.device == "cuda" and "nccl" in prof.links else ("gloo" if "gloo" in prof.links
                                                                         else next(iter(prof.links), "gloo"))
    return SlaConfig(profile=prof, ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
                     max_num_batched_tokens=args.max_num_batched_tokens or eng.max_num_batched_tokens,
                     max_num_seqs=args.max_num_seqs or eng.max_num_seqs, kv_tokens=kv_tokens, kv_link=link)
