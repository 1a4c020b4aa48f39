"""``pdserve up`` argument checks: fields the configs own are checked by the configs and named by flag."""
from __future__ import annotations

import pytest

from cluster.cli import build_parser
from cluster.up_checks import check_up_args
from cluster.up_flags import engine_overrides, router_overrides


@pytest.mark.parametrize("argv, flag", [
    (["--local-prefill-max-tokens", "-1"], "--local-prefill-max-tokens"),
    (["--prefill-queue-max-tokens", "-3"], "--prefill-queue-max-tokens"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks"),
    (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes"),
    (["--decode-num-kv-blocks", "0"], "--decode-num-kv-blocks"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--prefill", "-1"], "--prefill"),
    (["--max-num-requests", "0"], "--max-num-requests"),
    (["--max-num-requests", "256"], "--max-num-requests"),  # must stay below the router's 256 RPC threads
    (["--check-interval", "0"], "--check-interval"),
    (["--planner-interval", "0"], "--planner-interval"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["--speculative-method", "ngram", "--prompt-lookup-min", "0"], "--prompt-lookup-min"),
    (["--health-port", "70000"], "--health-port"),
    (["--quantization", "int4", "--quantization-group-size", "48"], "--quantization-group-size"),
])
def test_bad_flag_is_named(argv, flag):
    args = build_parser().parse_args(["up", *argv])
    with pytest.raises(ValueError) as e:
        check_up_args(args)
    assert str(e.value).startswith(flag + " must be")


@pytest.mark.parametrize("argv, message", [
    (["--speculative-method", "draft_model"], "--speculative-model must name the draft model"),
    (["--speculative-model", "no-such-model"], "--speculative-model: model 'no-such-model' is not a built-in"),
    (["--speculative-method", "ngram", "--speculative-model", "tiny-draft"],
     "--speculative-model is only used with method 'draft_model'"),
    (["--device", "cuda", "--engine-process"], "--engine-process with prefill or decode workers needs --device cpu"),
])
def test_bad_draft_model_flags_are_named(argv, message):
    args = build_parser().parse_args(["up", *argv])
    with pytest.raises(ValueError) as e:
        check_up_args(args)
    assert str(e.value).startswith(message), str(e.value)


def test_speculative_model_flag_sets_the_draft_model():
    args = build_parser().parse_args(["up", "--speculative-model", "tiny-draft", "--num-speculative-tokens", "3"])
    check_up_args(args)
    assert engine_overrides(args)["speculative_config"] == {"method": "draft_model", "model": "tiny-draft",
                                                             "num_speculative_tokens": 3}


def test_quantization_flags_reach_every_worker_engine():
    args = build_parser().parse_args(["up", "--quantization", "int4", "--quantization-group-size", "64",
                                      "--kv-cache-dtype", "int8"])
    check_up_args(args)
    o = engine_overrides(args)
    assert (o["quantization"], o["quantization_group_size"], o["kv_cache_dtype"]) == ("int4", 64, "int8")
    assert "quantization" not in engine_overrides(build_parser().parse_args(["up"]))


def test_the_cli_offers_every_engine_quantization():
    from engine.quant import QUANTIZATIONS

    for q in QUANTIZATIONS:  # the flag's choices are spelled out in up_flags (no torch import there)
        args = build_parser().parse_args(["up", "--quantization", q])
        check_up_args(args)
        assert engine_overrides(args)["quantization"] == q


def test_one_port_for_two_listeners_is_refused():
    from cluster.redis_server import pick_free_port

    port = pick_free_port()
    args = build_parser().parse_args(["up", "--port", str(port), "--http-port", "0", "--health-port", str(port)])
    with pytest.raises(ValueError, match=f"--health-port {port} is also --port"):
        check_up_args(args)


def test_defaults_pass():
    check_up_args(build_parser().parse_args(["up"]))
    check_up_args(build_parser().parse_args(["up", "--local-prefill-max-tokens", "128",
                                              "--prefill-queue-max-tokens", "0", "--num-kv-blocks", "64"]))


def test_max_num_requests_reaches_the_router_config():
    from router.config import RouterConfig

    args = build_parser().parse_args(["up", "--max-num-requests", "100"])
    check_up_args(args)
    overrides = router_overrides(args)
    assert overrides["max_num_requests"] == 100
    assert RouterConfig(**overrides).max_num_requests == 100
    assert "max_num_requests" not in router_overrides(build_parser().parse_args(["up"]))  # router default


def test_scheduling_policy_reaches_the_router_config():
    from router.config import RouterConfig

    args = build_parser().parse_args(["up", "--scheduling-policy", "priority"])
    check_up_args(args)
    assert RouterConfig(**router_overrides(args)).scheduling_policy == "priority"
    assert RouterConfig(**router_overrides(build_parser().parse_args(["up"]))).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="scheduling_policy"):
        RouterConfig(scheduling_policy="lifo")
    reset = build_parser().parse_args(["up", "--allow-prefix-cache-reset"])
    assert RouterConfig(**router_overrides(reset)).allow_prefix_cache_reset
    assert not RouterConfig(**router_overrides(args)).allow_prefix_cache_reset


def test_reasoning_parser_and_default_template_kwargs_reach_the_router_config(capsys):
    from router.config import RouterConfig

    args = build_parser().parse_args(["up", "--reasoning-parser", "qwen3",
                                      "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    check_up_args(args)
    cfg = RouterConfig(**router_overrides(args))
    assert (cfg.reasoning_parser, cfg.default_chat_template_kwargs) == ("qwen3", {"enable_thinking": False})
    plain = RouterConfig(**router_overrides(build_parser().parse_args(["up"])))
    assert plain.reasoning_parser is None and plain.default_chat_template_kwargs is None
    for argv in (["--reasoning-parser", "granite"], ["--default-chat-template-kwargs", "[1]"],
                 ["--default-chat-template-kwargs", "{nope"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up", *argv])
        assert argv[0] in capsys.readouterr().err
    with pytest.raises(ValueError, match="default_chat_template_kwargs.messages is set by the server"):
        RouterConfig(default_chat_template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        RouterConfig(reasoning_parser="granite")


def test_max_model_len_reaches_the_router_and_every_worker_engine():
    """`--max-model-len` (vLLM's flag) is one context length for the engines and the router's checks: a router that
    allowed more than its workers let a too-long prompt through to a worker, whose refusal named no API field."""
    from cluster.config import ClusterConfig, build_role_worker, build_router
    from router import StaticWorkerSource
    from router.model_info import load_model_view

    args = build_parser().parse_args(["up", "--max-model-len", "128"])
    check_up_args(args)
    cfg = ClusterConfig(model="tiny", engine_overrides=engine_overrides(args), router_overrides=router_overrides(args))
    assert load_model_view(build_router(cfg, StaticWorkerSource([])).cfg)[1].max_context_length == 128
    assert build_role_worker("colocated", "c0", cfg, None, "127.0.0.1", "n0").cfg.engine.max_model_len == 128
    router_args = build_parser().parse_args(["router", "--namespace", "ns", "--max-model-len", "96"])
    assert router_overrides(router_args)["max_context_length"] == 96
    plain = build_parser().parse_args(["up"])  # unset: the model's own length everywhere
    assert "max_model_len" not in engine_overrides(plain) and "max_context_length" not in router_overrides(plain)
    for argv, message in (
            (["1"], "--max-model-len must be >= 2, got 1"),
            (["4096"], "--max-model-len 4096 is longer than the model's max_position_embeddings (2048)"),
            (["512", "--decode-num-kv-blocks", "16"], "--max-model-len 512 does not fit --decode-num-kv-blocks 16 "
             "(256 tokens of 16-token blocks): one sequence of --max-model-len must fit a worker's cache")):
        with pytest.raises(ValueError) as e:
            check_up_args(build_parser().parse_args(["up", "--max-model-len", *argv]))
        assert str(e.value) == message
    check_up_args(build_parser().parse_args(["up", "--max-model-len", "256", "--num-kv-blocks", "16"]))  # just fits


def test_dtype_and_kv_cache_memory_flags_reach_every_worker_engine(monkeypatch):
    """`--dtype` and `--kv-cache-memory-bytes` (vLLM's names) set every worker's engine; `--dtype auto` (the default)
    is float32 on CPU and bfloat16 on CUDA (float16 on a GPU without it): before the flag a CUDA deployment ran
    float32 weights, twice the memory and none of the bf16 kernels the GPU engine is measured with."""
    import torch

    from cluster.config import ClusterConfig, auto_dtype, build_role_worker

    args = build_parser().parse_args(["up", "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(1 << 22)])
    check_up_args(args)
    assert engine_overrides(args) == {"dtype": "bfloat16", "kv_cache_memory_bytes": 1 << 22}
    cfg = ClusterConfig(model="tiny", engine_overrides=engine_overrides(args))
    engine = build_role_worker("colocated", "c0", cfg, None, "127.0.0.1", "n0").cfg.engine
    assert (engine.dtype, engine.kv_cache_memory_bytes) == ("bfloat16", 1 << 22)
    plain = build_parser().parse_args(["up"])
    assert "dtype" not in engine_overrides(plain) and "kv_cache_memory_bytes" not in engine_overrides(plain)
    engine = build_role_worker("colocated", "c1", ClusterConfig(model="tiny"), None, "127.0.0.1", "n0").cfg.engine
    assert engine.dtype == "float32"  # auto on CPU
    for bf16, want in ((True, "bfloat16"), (False, "float16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda bf16=bf16: bf16)
        assert auto_dtype(cuda=True) == want
        # (a worker on CUDA is built, not started, so this box can check what its engine would run)
        cuda = build_role_worker("colocated", "g0", ClusterConfig(model="tiny", device="cuda"), None, "127.0.0.1",
                                 "n0").cfg.engine
        assert (cuda.device, cuda.dtype) == ("cuda", want)
    chosen = ClusterConfig(model="tiny", device="cuda", engine_overrides={"dtype": "float32"})
    assert build_role_worker("colocated", "g1", chosen, None, "127.0.0.1", "n0").cfg.engine.dtype == "float32"
    assert auto_dtype(cuda=False) == "float32"


def test_served_model_name_reaches_router_and_workers(tmp_path):
    """`--served-model-name` names the model everywhere (router ModelInfo and /v1/models, metric labels, the
    workers' records); without it the name is the built-in one or the model directory's basename, no path."""
    from cluster.config import ClusterConfig, build_role_worker, build_router
    from router import StaticWorkerSource

    args = build_parser().parse_args(["up", "--served-model-name", "acme/coder-7b"])
    check_up_args(args)
    assert args.served_model_name == "acme/coder-7b"
    with pytest.raises(ValueError) as e:
        check_up_args(build_parser().parse_args(["up", "--served-model-name", " "]))
    assert str(e.value).startswith("--served-model-name must be")

    model_dir = tmp_path / "models" / "Qwen2.5-0.5B"
    model_dir.mkdir(parents=True)
    assert ClusterConfig().served_model_name == "tiny"
    assert ClusterConfig(model="bench").served_model_name == "bench"
    assert ClusterConfig(model=str(model_dir) + "/").served_model_name == "Qwen2.5-0.5B"
    with pytest.raises(ValueError, match="served_model_name"):
        ClusterConfig(served_model_name="")

    cfg = ClusterConfig(model="tiny", served_model_name=args.served_model_name)
    router = build_router(cfg, StaticWorkerSource([]))
    assert router.cfg.model_name == router.cfg.served_model_name == "acme/coder-7b"
    worker = build_role_worker("colocated", "c0", cfg, None, "127.0.0.1", "n0")
    assert worker.cfg.served_model_name == "acme/coder-7b"
    assert worker.info().model_name == "acme/coder-7b"
    path_cfg = ClusterConfig(model=str(model_dir))
    assert build_router(path_cfg, StaticWorkerSource([])).cfg.served_model_name == "Qwen2.5-0.5B"
    assert build_role_worker("colocated", "c1", path_cfg, None, "127.0.0.1", "n0").cfg.served_model_name \
        == "Qwen2.5-0.5B"


def test_api_keys_file_and_quota_routers_reach_the_router_config(tmp_path):
    good = tmp_path / "keys.toml"
    good.write_text('[[key]]\nname = "a"\nkey = "pdk-aaaaaaaa"\nmax_concurrent = 4\n')
    args = build_parser().parse_args(["up", "--api-keys-file", str(good), "--quota-routers", "2"])
    check_up_args(args)
    assert router_overrides(args)["api_keys_file"] == str(good) and router_overrides(args)["quota_routers"] == 2
    bad = tmp_path / "bad.toml"
    bad.write_text('[[key]]\nname = "a"\nkey = "short"\n')
    for path, message in ((bad, "key[0].key"), (tmp_path / "missing.toml", "missing.toml")):
        with pytest.raises(ValueError) as e:
            check_up_args(build_parser().parse_args(["up", "--api-keys-file", str(path)]))
        assert "--api-keys-file" in str(e.value) and message in str(e.value)
    with pytest.raises(ValueError, match="--quota-routers"):
        check_up_args(build_parser().parse_args(["up", "--quota-routers", "0"]))


@pytest.mark.parametrize("cmd", ["up", "router"])
def test_replica_sync_and_pending_flags_reach_the_router_config(cmd):
    from router.config import RouterConfig

    argv = [cmd, "--no-kv-replica-sync", "--kv-pending-s", "0.5"] + (["--namespace", "ns"] if cmd == "router" else [])
    cfg = RouterConfig(**router_overrides(build_parser().parse_args(argv)))
    assert (cfg.kv_replica_sync, cfg.kv_pending_s) == (False, 0.5)
    default = RouterConfig(**router_overrides(build_parser().parse_args([cmd] + argv[4:])))
    assert (default.kv_replica_sync, default.kv_pending_s) == (True, 2.0)


def test_engine_process_flag_reaches_the_cluster_config():
    from cluster.config import ClusterConfig
    from cluster.up_flags import pool_config_kwargs

    args = build_parser().parse_args(["up", "--colocated", "2", "--engine-process"])
    check_up_args(args)
    cfg = ClusterConfig(**pool_config_kwargs(args))
    assert cfg.engine_process is True and cfg.num_colocated == 2
    assert ClusterConfig(**pool_config_kwargs(build_parser().parse_args(["up"]))).engine_process is False
    with pytest.raises(ValueError, match="engine_process with prefill or decode pools needs device cpu"):
        ClusterConfig(num_colocated=0, engine_process=True, device="cuda")
    # every pool's workers get it (the prefill and decode roles' engine process shares its KV cache)
    from cluster.config import build_role_worker
    from kvtransfer import StoreConfig

    store = StoreConfig("redis://127.0.0.1:1/0", namespace="unused")  # built, not started: never dialled
    both = ClusterConfig(**pool_config_kwargs(build_parser().parse_args(["up", "--engine-process"])))
    for role in ("prefill", "decode", "colocated"):
        assert build_role_worker(role, f"{role}-0", both, store, "127.0.0.1", "n0").cfg.engine_process is True


def test_no_kv_shm_flag_reaches_the_worker_configs():
    from cluster.config import ClusterConfig
    from cluster.up_flags import pool_config_kwargs
    from worker_common.config import WorkerConfig

    assert ClusterConfig(**pool_config_kwargs(build_parser().parse_args(["up"]))).kv_shm is True
    cfg = ClusterConfig(**pool_config_kwargs(build_parser().parse_args(["up", "--no-kv-shm"])))
    assert cfg.kv_shm is False
    with pytest.raises(ValueError, match="kv_shm must be a bool"):
        ClusterConfig(kv_shm="no")
    with pytest.raises(ValueError, match="kv_shm must be a bool"):
        WorkerConfig(worker_id="w", kv_shm=0)
    from cluster.config import build_role_worker
    from kvtransfer import StoreConfig

    store = StoreConfig("redis://127.0.0.1:1/0", namespace="unused")  # built, not started: never dialled
    assert build_role_worker("decode", "d-0", cfg, store, "127.0.0.1", "n0").cfg.kv_shm is False
    assert build_role_worker("prefill", "p-0", cfg, store, "127.0.0.1", "n0").cfg.engine.kv_cache_shared is False
    on = ClusterConfig(**pool_config_kwargs(build_parser().parse_args(["up"])))
    # the prefill worker's cache is shared (its decode peers pull from it); the decode worker's stays private
    assert build_role_worker("prefill", "p-0", on, store, "127.0.0.1", "n0").cfg.engine.kv_cache_shared is True
    assert build_role_worker("decode", "d-0", on, store, "127.0.0.1", "n0").cfg.engine.kv_cache_shared is False


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an integer >= 1"),
    (["--prefill-tp", "0"], "--prefill-tp must be an integer >= 1"),
    (["--decode-tp", "3"], r"--decode-tp=3 and the model's num_key_value_heads \(2\) must divide one another"),
    (["--prefill-tp", "4"], r"--prefill-tp=4 must divide the model's num_attention_heads \(6\)"),
    (["--prefill", "0", "--decode", "0", "--colocated", "1", "--tensor-parallel-size", "4"],
     r"--tensor-parallel-size=4 must divide the model's num_attention_heads \(6\)"),
    (["--prefill", "0", "--decode", "0", "--colocated", "1", "--tensor-parallel-size", "2", "--engine-process"],
     "--tensor-parallel-size 2 cannot be combined with --engine-process"),
])
def test_a_tensor_parallel_size_that_cannot_work_is_refused_naming_the_flag(argv, message):
    args = build_parser().parse_args(["up", *argv])
    with pytest.raises(ValueError, match=message):
        check_up_args(args)


def test_tensor_parallel_size_reaches_the_colocated_engines():
    args = build_parser().parse_args(["up", "--prefill", "0", "--decode", "0", "--colocated", "1",
                                      "--tensor-parallel-size", "2"])
    check_up_args(args)
    assert engine_overrides(args)["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in engine_overrides(build_parser().parse_args(["up"]))


def test_pool_tp_flags_reach_each_pool():
    from cluster.config import pool_tp
    from cluster.up_flags import pool_config_kwargs

    args = build_parser().parse_args(["up", "--prefill-tp", "2", "--decode-num-kv-blocks", "900",
                                      "--num-kv-blocks", "100"])
    check_up_args(args)
    kw = pool_config_kwargs(args)
    assert kw["pool_tensor_parallel"] == {"prefill": 2} and kw["pool_num_kv_blocks"] == {"decode": 900}
    from cluster.config import ClusterConfig

    cfg = ClusterConfig(**{k: v for k, v in kw.items() if k in ClusterConfig.__dataclass_fields__})
    assert (pool_tp(cfg, "prefill"), pool_tp(cfg, "decode")) == (2, 1)
    with pytest.raises(ValueError, match=r"pool_num_kv_blocks\['decode'\] must be an integer >= 1"):
        ClusterConfig(pool_num_kv_blocks={"decode": 0})
    from cluster.config import build_role_worker
    from kvtransfer import StoreConfig

    store = StoreConfig("redis://127.0.0.1:1/0", namespace="unused")  # built, not started: never dialled
    engines = {role: build_role_worker(role, f"{role}-0", cfg, store, "127.0.0.1", "n0").cfg.engine
               for role in ("prefill", "decode")}
    assert (engines["prefill"].num_kv_blocks, engines["decode"].num_kv_blocks) == (100, 900)
    assert (engines["prefill"].tensor_parallel_size, engines["decode"].tensor_parallel_size) == (2, 1)


@pytest.mark.parametrize("cmd", ["up", "router"])
def test_one_loop_flag_reaches_the_router_config(cmd):
    from router.config import RouterConfig

    extra = ["--namespace", "ns"] if cmd == "router" else []
    assert RouterConfig(**router_overrides(build_parser().parse_args([cmd, "--one-loop"] + extra))).one_loop is True
    assert RouterConfig(**router_overrides(build_parser().parse_args([cmd] + extra))).one_loop is False


def test_lora_modules_flag_reaches_every_worker_engine_and_bad_adapters_are_refused_first(tmp_path, monkeypatch):
    """`--lora-modules NAME=PATH ...` (vLLM's flag): every worker engine gets the adapters by absolute path (a Ray
    worker's working directory is not the CLI's); an adapter that cannot be read or does not fit the model, or that
    takes the served model's name, is refused before anything starts, naming the flag and the adapter."""
    pytest.importorskip("peft")
    from cluster.config import ClusterConfig, build_role_worker
    from tests.roles.test_lora_cluster import make_tiny_adapters

    dirs = make_tiny_adapters(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["up", "--lora-modules", "py=py", f"alt={dirs['alt']}"])
    check_up_args(args)
    assert engine_overrides(args)["lora_modules"] == {"py": dirs["py"], "alt": dirs["alt"]}
    cfg = ClusterConfig(model="tiny", engine_overrides=engine_overrides(args))
    assert build_role_worker("colocated", "c0", cfg, None, "127.0.0.1", "n0").cfg.engine.lora_modules == dirs
    assert "lora_modules" not in engine_overrides(build_parser().parse_args(["up"]))
    for argv, message in (
            (["py"], "--lora-modules: each entry must be 'name=path'"),
            (["tiny=py"], "--lora-modules: adapter name 'tiny' is the served model name"),
            ([f"x={tmp_path}"], "--lora-modules: adapter 'x' ("),
            ([f"py={dirs['py']}", "--model", "bench"], "--lora-modules: adapter 'py' (")):
        with pytest.raises(ValueError) as e:
            check_up_args(build_parser().parse_args(["up", "--lora-modules", *argv]))
        assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("cmd", ["up", "router"])
def test_runtime_lora_flag_reaches_the_router_config(cmd):
    from router.config import RouterConfig

    extra = ["--namespace", "ns"] if cmd == "router" else []
    cfg = RouterConfig(**router_overrides(build_parser().parse_args([cmd, "--allow-runtime-lora-updating", *extra])))
    assert cfg.allow_runtime_lora_updating is True
    assert RouterConfig(**router_overrides(build_parser().parse_args([cmd, *extra]))).allow_runtime_lora_updating \
        is False


def test_lora_resolver_dir_needs_runtime_updating_and_an_absolute_path():
    from router.config import RouterConfig

    ok = build_parser().parse_args(["up", "--allow-runtime-lora-updating", "--lora-resolver-dir", "/srv/adapters"])
    assert RouterConfig(**router_overrides(ok)).lora_resolver_dir == "/srv/adapters"
    for argv, flag in ((["--lora-resolver-dir", "/srv/adapters"], "--allow-runtime-lora-updating"),
                       (["--allow-runtime-lora-updating", "--lora-resolver-dir", "adapters"], "absolute")):
        with pytest.raises(ValueError, match=flag):
            router_overrides(build_parser().parse_args(["up", *argv]))
    with pytest.raises(ValueError, match="allow_runtime_lora_updating"):
        RouterConfig(lora_resolver_dir="/srv/adapters")


@pytest.mark.parametrize("cmd", ["up", "router"])
def test_responses_store_flag_reaches_the_router_config(cmd):
    from router.config import RouterConfig

    extra = ["--namespace", "ns"] if cmd == "router" else []
    cfg = RouterConfig(**router_overrides(build_parser().parse_args([cmd, "--responses-store-ttl-s", "90", *extra])))
    assert cfg.responses_store_ttl_s == 90
    assert RouterConfig(**router_overrides(build_parser().parse_args([cmd, *extra]))).responses_store_ttl_s is None
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ValueError, match="^--responses-store-ttl-s must be a finite number"):
            router_overrides(build_parser().parse_args([cmd, "--responses-store-ttl-s", bad, *extra]))
    with pytest.raises(ValueError, match="responses_store_ttl_s must be > 0"):
        RouterConfig(responses_store_ttl_s=0)


def test_pdserve_up_runs_an_encoder_as_one_colocated_pool(tmp_path, capsys):
    """An encoder's work is all prompts: its --prefill + --decode workers become one colocated pool (said on
    stderr), unless --colocated says how many; a decoder keeps its two pools."""
    from cluster.cli import build_parser
    from cluster.up_checks import encoder_pools
    from cluster.up_flags import pool_config_kwargs

    from ..engine.test_encoder import _bert, _save, _tokenizer

    d = str(_save(_bert(), _tokenizer("bert"), tmp_path / "bge"))
    args = build_parser().parse_args(["up", "--model", d, "--decode", "2"])
    assert encoder_pools(args) and "is an encoder" in capsys.readouterr().err
    kw = pool_config_kwargs(args)
    assert (kw["num_colocated"], kw["num_prefill"], kw["num_decode"]) == (3, 0, 0)
    args = build_parser().parse_args(["up", "--model", d, "--colocated", "2"])
    assert not encoder_pools(args) and args.colocated == 2
    args = build_parser().parse_args(["up", "--model", "tiny"])
    assert not encoder_pools(args) and (args.colocated, args.prefill, args.decode) == (0, 1, 1)


def test_pdserve_up_refuses_a_quantized_checkpoint_it_cannot_load_before_anything_starts(tmp_path):
    from cluster.cli import build_parser
    from cluster.up_checks import check_model_args

    from ..engine.test_prequantized import _gptq_checkpoint

    _gptq_checkpoint(tmp_path / "awq", quant_method="awq")
    with pytest.raises(ValueError, match="--model .*awq.*quant_method 'awq' checkpoints are not loaded"):
        check_model_args(build_parser().parse_args(["up", "--model", str(tmp_path / "awq")]))
    _gptq_checkpoint(tmp_path / "gptq")
    check_model_args(build_parser().parse_args(["up", "--model", str(tmp_path / "gptq")]))
    with pytest.raises(ValueError, match="--quantization: .* gptq int4 g32 checkpoint"):
        check_model_args(build_parser().parse_args(["up", "--model", str(tmp_path / "gptq"), "--quantization",
                                                    "int4"]))
