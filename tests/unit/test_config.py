"""The configuration tree: presets, environment overrides, unknown keys."""

from __future__ import annotations

import hashlib
import re

import pytest

from services.config import CONFIG_DIR, DEFAULT_TOKEN, ConfigError, Settings, dump_settings, load_settings


@pytest.mark.parametrize("preset", sorted(str(p.relative_to(CONFIG_DIR).with_suffix(""))
                                          for p in CONFIG_DIR.rglob("*.yaml")))
def test_every_preset_loads(preset):
    settings = load_settings(preset)
    assert isinstance(settings, Settings)
    assert Settings(**load_settings(preset).model_dump()) == settings  # the dump is a valid config again


def test_paper_recipe_values():
    s = load_settings("dapo-qwen2.5-32b")
    assert s.model.name_or_path == "Qwen/Qwen2.5-32B"
    assert (s.learner.optimizer.lr, s.learner.optimizer.warmup_steps, s.learner.optimizer.weight_decay,
            s.learner.optimizer.grad_clip) == (1e-6, 20, 0.1, 1.0)
    assert (s.learner.batch.prompts_per_step, s.sampling.n, s.learner.batch.mini_batches) == (512, 16, 16)
    assert (s.learner.loss.clip_low, s.learner.loss.clip_high) == (0.2, 0.28)
    assert s.sampling.max_tokens == 20480 and s.reward.overlong_buffer == 4096
    assert s.sampling.temperature == 1.0 and s.eval_sampling.top_p == 0.7 and s.eval_sampling.n == 32
    assert s.learner.loss.kl_coef == 0.0 and s.learner.loss.entropy_coef == 0.0
    assert (s.learner.loss.loss_agg == "token" and s.learner.batch.dynamic_sampling
            and s.learner.batch.filter_metric == "acc")
    assert s.learner.loss.dual_clip == 10.0  # clip_ratio_c of verl's run_dapo_qwen2.5_32b.sh
    assert s.generator.logprobs_mode == "processed_logprobs"  # mu of the distribution actually sampled


def test_ablation_rows_are_cumulative_configs():
    grpo = load_settings("ablations/1-grpo")
    assert grpo.learner.loss.clip_high == 0.2 and grpo.learner.loss.loss_agg == "sample"
    assert (not grpo.learner.batch.dynamic_sampling and not grpo.reward.soft_overlong
            and not grpo.learner.loss.overlong_filter)
    assert grpo.learner.optimizer.lr == 1e-6  # inherited from the recipe
    full = load_settings("ablations/6-dynamic-sampling")
    assert (full.learner.loss.clip_high == 0.28 and full.learner.loss.loss_agg == "token"
            and full.learner.batch.dynamic_sampling)
    assert full.reward.soft_overlong and full.learner.loss.overlong_filter
    # The full row is the main recipe but for the overlong filter kept from row 2 (its comment says why).
    main = load_settings("dapo-qwen2.5-32b")
    def leaves(tree: dict, prefix: str = "") -> dict:
        return {k: v for key, value in tree.items()
                for k, v in (leaves(value, f"{prefix}{key}.") if isinstance(value, dict)
                             else {f"{prefix}{key}": value}).items()}

    sections = ("learner", "reward", "sampling", "data", "model", "generator")
    full_leaves, main_leaves = (leaves({s: getattr(c, s).model_dump() for s in sections}) for c in (full, main))
    assert {key for key, value in full_leaves.items() if main_leaves[key] != value} == {"learner.loss.overlong_filter"}


def test_every_preset_has_its_own_run_folder_and_redis_prefix():
    """Two presets sharing a run folder would resume each other's checkpoint (resume is on by default)."""
    presets = sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.rglob("*.yaml"))
    loaded = {name: load_settings(name) for name in presets}
    run_dirs = [s.run_dir for s in loaded.values()]
    prefixes = [s.redis.run for s in loaded.values()]
    assert len(set(run_dirs)) == len(presets), run_dirs
    assert len(set(prefixes)) == len(presets), prefixes


def test_environment_overrides_nested_fields(monkeypatch):
    monkeypatch.setenv("DAPO_LEARNER__CLIP_HIGH", "0.3")
    monkeypatch.setenv("DAPO_REDIS__URL", "redis://example:6379/0")
    monkeypatch.setenv("DAPO_TOKEN", "s3cret")
    s = load_settings("tiny-cpu")
    assert s.learner.loss.clip_high == 0.3
    assert s.redis.url.get_secret_value() == "redis://example:6379/0"
    assert s.token.get_secret_value() == "s3cret"
    assert s.learner.batch.prompts_per_step == load_settings("tiny-cpu", learner={}).learner.batch.prompts_per_step


def test_environment_beats_yaml(monkeypatch):
    assert load_settings("tiny-cpu").sampling.n == 8
    monkeypatch.setenv("DAPO_SAMPLING__N", "4")
    assert load_settings("tiny-cpu").sampling.n == 4


def test_unknown_key_names_the_key_and_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  clip_hihg: 0.3\n")
    with pytest.raises(ConfigError) as err:
        load_settings(bad)
    assert "learner.clip_hihg" in str(err.value) and "unknown key" in str(err.value) and str(bad) in str(err.value)


def test_bad_value_and_missing_preset_are_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  loss_agg: average\n")
    with pytest.raises(ConfigError, match="learner.loss.loss_agg"):
        load_settings(bad)
    with pytest.raises(ConfigError, match="not found.*presets: .*tiny-cpu"):
        load_settings("no-such-preset")


def test_dump_round_trips(tmp_path):
    """Without its secrets (which services read from the environment), a dump reads back as the same settings."""
    s = load_settings("dapo-qwen2.5-math-1.5b", token="a-long-enough-secret", redis={"url": "redis://:pw@r:6379/0"})
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_settings(s, without_secrets=True))
    env = {"DAPO_TOKEN": "a-long-enough-secret", "DAPO_REDIS__URL": "redis://:pw@r:6379/0"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        assert load_settings(path) == s


def test_auto_dtype_is_bf16_on_gpu_and_fp32_on_cpu():
    model = load_settings("tiny-cpu", model={"dtype": "auto"}).model
    assert model.resolved_dtype(on_gpu=True) == "bfloat16" and model.resolved_dtype(on_gpu=False) == "float32"
    assert load_settings("dapo-qwen2.5-32b").model.resolved_dtype(on_gpu=False) == "bfloat16"  # explicit wins


def test_cli_set_overrides_parse_yaml_values():
    from cli.main import build_parser, parse_overrides

    overrides = parse_overrides(["learner.optimizer.lr=3e-4", "sampling.n=4", "redis.url=redis://r:6379/0"])
    s = load_settings("tiny-cpu", **overrides)
    assert (s.learner.optimizer.lr, s.sampling.n, s.redis.url.get_secret_value()) == (3e-4, 4, "redis://r:6379/0")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["learner.optimizer.lr"])
    args = build_parser().parse_args(["bootstrap", "--force"])
    assert args.force and not args.measure


def test_errors_name_where_the_bad_key_came_from(tmp_path, monkeypatch):
    base = tmp_path / "base.yaml"
    base.write_text("learner:\n  clip_hihg: 0.3\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\nsampling:\n  n: 4\n")
    with pytest.raises(ConfigError, match=rf"learner.clip_hihg: unknown key \(from {base}\)"):
        load_settings(child)  # the file of the chain that holds the key, not the one named
    with pytest.raises(ConfigError, match=r"learner.clip_hihg: unknown key \(from --set learner.clip_hihg\)"):
        load_settings("tiny-cpu", origin="--set", learner={"clip_hihg": 0.3})
    monkeypatch.setenv("DAPO_LEARNER__CLIP_HIHG", "0.3")
    with pytest.raises(ConfigError, match=r"\(from environment variable DAPO_LEARNER__CLIP_HIHG\)"):
        load_settings("tiny-cpu")


def test_set_beats_the_environment_which_beats_the_preset(monkeypatch):
    monkeypatch.setenv("DAPO_SAMPLING__N", "4")
    assert load_settings("tiny-cpu").sampling.n == 4
    assert load_settings("tiny-cpu", sampling={"n": 2}).sampling.n == 2
    assert (load_settings("tiny-cpu", sampling={"n": 2}).learner.optimizer.lr
            == load_settings("tiny-cpu").learner.optimizer.lr)


def test_dapo_version_and_a_bad_set_key_from_the_command_line(capsys):
    from importlib.metadata import version

    from cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"dapo {version('dapo-services')}"
    assert main(["reward", "--set", "reward.wrokers=2"]) == 2
    err = capsys.readouterr().err
    assert "reward.wrokers: unknown key (from --set reward.wrokers)" in err and "Traceback" not in err



@pytest.mark.parametrize("sets, said", [
    (["learner.total_steps=20", "learner.total_steps.x=1"], "learner.total_steps is already set to a value"),
    (["learner=5", "learner.total_steps=3"], "learner is already set to a value"),
    (["learner.total_steps=3", "learner=5"], "keys under learner are already set"),
])
def test_a_set_key_that_is_both_a_value_and_a_section_is_one_line(sets, said, capsys):
    from cli.main import main

    assert main(["reward", *(arg for pair in sets for arg in ("--set", pair))]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_a_log_level_in_lower_case_works_and_a_bad_one_is_one_line(monkeypatch, capsys):
    from cli.main import main

    monkeypatch.setenv("DAPO_LOG_LEVEL", "loud")
    assert main(["reward", "--set", "reward.wrokers=2"]) == 2
    assert "DAPO_LOG_LEVEL='loud' is not a log level" in capsys.readouterr().err
    monkeypatch.setenv("DAPO_LOG_LEVEL", "debug")
    assert main(["reward", "--set", "reward.wrokers=2"]) == 2  # got past the level: the config's error
    assert "unknown key" in capsys.readouterr().err


@pytest.mark.parametrize("token", ["", "two words", "clé-secrète"])
def test_a_token_that_cannot_travel_in_an_http_header_is_refused(token, monkeypatch):
    monkeypatch.setenv("DAPO_TOKEN", token)
    with pytest.raises(ConfigError, match="token must be printable ASCII"):
        load_settings("tiny-cpu")


@pytest.mark.parametrize("overrides,conflict", [
    ({"sampling": {"max_tokens": 256}, "reward": {"overlong_buffer": 16}}, "sampling.max_tokens 256 leaves no room"),
    ({"eval_sampling": {"max_tokens": 300}}, "eval_sampling.max_tokens 300 leaves no room"),
    ({"sampling": {"n": 1}}, "sampling.n 1: a group of one response has advantage 0"),
    ({"sampling": {"n": 1}, "learner": {"batch": {"dynamic_sampling": False}}}, "sampling.n 1: a group of one"),
    ({"learner": {"batch": {"oversample_min": 3.0, "oversample_max": 2.0}}}, "oversample_min 3.0 is above"),
    ({"weights": {"transport": "shared-fs"}}, "shared-fs needs weights.shared_dir"),
    ({"generator": {"in_process_engine": True, "tensor_parallel_size": 2}}, "tensor_parallel_size 2 needs"),
    ({"sampling": {"max_tokens": 400}, "generator": {"max_model_len": 1024}},
     "tiny.max_position 512) cannot hold generator.max_model_len 1024"),
    ({"reward": {"overlong_buffer": 64}}, "reward.overlong_buffer 64 is not below sampling.max_tokens 64"),
    ({"learner": {"compute": {"sequence_parallel": 2, "packing": "off"}}}, "packing off leaves none"),
    ({"token": "t" * 32, "weights_token": "t" * 32}, "weights_token equals token"),
    ({"generator": {"logprobs_mode": "raw_logprobs"}, "sampling": {"temperature": 0.7}},
     "raw_logprobs gives the logprobs before sampling.temperature 0.7"),
    ({"learner": {"compute": {"fsdp_offload": True}}}, "with fsdp false each rank holds a whole replica"),
    ({"learner": {"compute": {"fsdp_shard_ranks": 8}}}, "with fsdp false each rank holds a whole replica"),
    ({"learner": {"compute": {"fsdp": True}}, "model": {"dtype": "float16"}}, "FSDP's gradients get no loss scaling"),
    ({"sampling": {"top_p": 0.7}}, "every weight is the nucleus' mass"),
])
def test_settings_that_cannot_work_together_are_refused_when_loaded(overrides, conflict):
    with pytest.raises(ConfigError, match="cannot work together") as err:
        load_settings("tiny-cpu", **overrides)
    assert conflict in str(err.value)


def test_an_intermediate_override_may_conflict_if_the_final_settings_do_not():
    # max_tokens first (past the preset's 256-token context), then the context that makes room for it
    settings = load_settings("tiny-cpu", sampling={"max_tokens": 400}, generator={"max_model_len": 512})
    assert (settings.sampling.max_tokens, settings.generator.max_model_len) == (400, 512)
    assert load_settings("tiny-cpu",
                         reward={"overlong_buffer": 64, "soft_overlong": False}).reward.overlong_buffer == 64


def test_a_section_check_waits_for_every_source(monkeypatch):
    """The environment sets one half of a pair, --set the other: checked once both are in."""
    monkeypatch.setenv("DAPO_WEIGHTS__TRANSPORT", "shared-fs")
    monkeypatch.setenv("DAPO_GENERATOR__TENSOR_PARALLEL_SIZE", "2")
    settings = load_settings("tiny-cpu", weights={"shared_dir": "/w"}, generator={"in_process_engine": False})
    assert (settings.weights.shared_dir, settings.generator.tensor_parallel_size) == ("/w", 2)


def test_a_list_variable_that_is_not_json_and_a_set_value_that_is_not_yaml_are_one_line_errors(monkeypatch, capsys):
    from cli.main import main

    monkeypatch.setenv("DAPO_LEARNER__REPORT_TO", "wandb")
    with pytest.raises(ConfigError, match="DAPO_LEARNER__REPORT_TO"):
        load_settings("tiny-cpu")
    monkeypatch.delenv("DAPO_LEARNER__REPORT_TO")
    assert main(["reward", "--set", "data.synthetic_ops=*+"]) == 2
    err = capsys.readouterr().err
    assert "--set data.synthetic_ops: the value '*+' is not valid YAML" in err and "Traceback" not in err


def test_stale_groups_without_a_behaviour_correction_are_refused_unless_accepted():
    mid = load_settings("dapo-qwen2.5-math-1.5b")
    # its stale groups get the TIS weight
    assert mid.learner.batch.max_staleness == 1 and mid.learner.loss.tis_cap == 2.0
    with pytest.raises(ConfigError, match="max_staleness 1 .*tis_cap null"):
        load_settings("dapo-qwen2.5-math-1.5b", learner={"loss": {"tis_cap": None}})
    accepted = load_settings("dapo-qwen2.5-math-1.5b",
                             learner={"loss": {"tis_cap": None}, "batch": {"uncorrected_staleness": True}})
    assert accepted.learner.loss.tis_cap is None
    assert load_settings("dapo-qwen2.5-32b").learner.loss.tis_cap is None  # synchronous: nothing stale to correct


def test_gradient_checkpointing_takes_a_mode_and_the_old_switch():
    assert load_settings("dapo-qwen2.5-32b").learner.compute.gradient_checkpointing == "full"
    # measured fastest on a GPU, and it fits 80 GB
    single_node = load_settings("dapo-qwen2.5-math-1.5b").learner.compute
    assert (single_node.gradient_checkpointing, single_node.compile) == ("selective", True)
    assert load_settings("tiny-cpu").learner.compute.gradient_checkpointing == "off"
    for value, mode in ((True, "full"), (False, "off"), ("selective", "selective")):
        compute = load_settings("tiny-cpu", learner={"compute": {"gradient_checkpointing": value}}).learner.compute
        assert compute.gradient_checkpointing == mode
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        load_settings("tiny-cpu", learner={"compute": {"gradient_checkpointing": "some"}})


def test_switch_words_mean_the_settings_own_words_from_yaml_and_the_environment(tmp_path, monkeypatch):
    """YAML reads on / off as booleans (`packing: on`, as the project's own messages say to set it), the
    environment gives true / false as text: each is the setting's on or off. A number where a name is meant is
    refused, not turned into other text (YAML 1.1 reads 010 as 8)."""
    preset = tmp_path / "p.yaml"
    preset.write_text("base: tiny-cpu\nlearner:\n  compute:\n    packing: on\nweights:\n  verify: off\n")
    settings = load_settings(preset)
    assert (settings.learner.compute.packing, settings.weights.verify) == ("on", "off")
    with pytest.raises(ConfigError, match=r"redis.run: Input should be a valid string \(YAML read 8: quote it\)"):
        load_settings("tiny-cpu", redis={"run": 8})
    assert load_settings("tiny-cpu", cpus={"learner": 1}).cpus.learner == "1"  # one CPU is a CPU list
    monkeypatch.setenv("DAPO_LEARNER__COMPUTE__GRADIENT_CHECKPOINTING", "true")
    monkeypatch.setenv("DAPO_LEARNER__COMPUTE__PACKING", "false")
    compute = load_settings("tiny-cpu", weights={"verify": True}).learner.compute
    assert (compute.gradient_checkpointing, compute.packing) == ("full", "off")
    assert load_settings("tiny-cpu", weights={"verify": True}).weights.verify == "full"


@pytest.mark.parametrize("text,error", [
    ("base: tiny-cpu\nlearner:\n  total_steps: 5\nlearner:\n  total_steps: 6\n",
     "key 'learner' is given twice \\(first on line 2\\)"),
    ("base: tiny-cpu\nlearner:\n  loss:\n    clip_low: 0.1\n    clip_low: 0.2\n", "key 'clip_low' is given twice"),
    ("base: tiny-cpu\n2024: x\n", "key 2024 is not a name"),
    ("on: true\n", "key True is not a name"),
    ("", "is empty"),
    ("base: tiny-cpu\nx: &s {temperature: 1.0}\n", "x: unknown key"),  # anchors and merges are YAML's own
    ("base: tiny-cpu\nsampling: &s {temperature: 1.0}\neval_sampling: {<<: *s, top_p: 0.7, top_p: 0.8}\n",
     "key 'top_p' is given twice"),
    ("# nothing but a comment\n", "is empty"),
])
def test_a_preset_that_would_lose_or_hide_what_it_says_is_refused(tmp_path, text, error):
    """A section given twice would replace the first whole, silently (yaml's last one wins); a key YAML reads as a
    value cannot name a field; an empty file would run the bare defaults, which do not work together."""
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_settings(preset)


def test_a_preset_may_merge_a_mapping_and_override_its_keys(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("base: tiny-cpu\nsampling: &s {temperature: 0.9, top_p: 1.0}\n"
                      "eval_sampling: {<<: *s, top_p: 0.7}\n")
    settings = load_settings(preset)
    assert (settings.eval_sampling.temperature, settings.eval_sampling.top_p) == (0.9, 0.7)


def test_a_runs_config_yaml_reads_back_with_its_secrets_from_the_environment(tmp_path, monkeypatch):
    """run_dir/config.yaml shows the secrets redacted: read back, the mask is never taken for the secret itself."""
    from learner.records import Records

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path), token="a-long-enough-secret",
                             token_sha256=hashlib.sha256(b"a-long-enough-secret").hexdigest(),
                             redis={"password": "pw"})
    Records.write_config(settings)
    assert "**********" in (tmp_path / "config.yaml").read_text()
    back = load_settings(tmp_path / "config.yaml")
    assert back.token.get_secret_value() == DEFAULT_TOKEN and back.token_sha256 is None and back.redis.password is None
    monkeypatch.setenv("DAPO_TOKEN", "a-long-enough-secret")
    assert load_settings(tmp_path / "config.yaml").token.get_secret_value() == "a-long-enough-secret"


def test_dapo_run_refuses_shard_groups_that_do_not_divide_its_learner_processes(tmp_path):
    from cli.launcher import main

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path),
                             learner={"compute": {"fsdp": True, "fsdp_shard_ranks": 2}})
    with pytest.raises(ConfigError, match="fsdp_shard_ranks 2 must divide the learner's processes"):
        main(settings, learner_procs=3, display=False)
    assert not any(tmp_path.iterdir())


def test_a_moved_key_still_loads_with_one_line_naming_the_new_one(caplog, monkeypatch):
    from services.config import MOVED_KEYS

    assert MOVED_KEYS[("learner", "keep_versions")] == ("weights", "keep_versions")
    with caplog.at_level("WARNING"):
        settings = load_settings("tiny-cpu", learner={"keep_versions": 7})
    assert settings.weights.keep_versions == 7 and not hasattr(settings.learner, "keep_versions")
    assert "learner.keep_versions is now weights.keep_versions" in caplog.text
    both = load_settings("tiny-cpu", learner={"keep_versions": 7}, weights={"keep_versions": 5})
    assert both.weights.keep_versions == 5  # the new key wins
    monkeypatch.setenv("DAPO_LEARNER__KEEP_VERSIONS", "9")  # the old environment variable too
    assert load_settings("tiny-cpu").weights.keep_versions == 9


def test_the_learner_flat_keys_of_before_load_into_their_sections_and_each_source_keeps_its_priority(
        caplog, monkeypatch, tmp_path):
    from services.config import MOVED_KEYS

    assert MOVED_KEYS[("learner", "lr")] == ("learner", "optimizer", "lr")
    assert MOVED_KEYS[("learner", "checkpoint_every")] == ("learner", "checkpoints", "every")
    assert MOVED_KEYS[("learner", "batch_warmup_steps")] == ("learner", "batch", "warmup_steps")
    assert MOVED_KEYS[("learner", "warmup_steps")] == ("learner", "optimizer", "warmup_steps")  # the LR warm-up
    with caplog.at_level("WARNING"):
        old = load_settings("tiny-cpu", learner={"lr": 3e-4, "clip_high": 0.3, "micro_batch_tokens": 512,
                                                 "checkpoint_every": 3, "prompts_per_step": 8})
    learner = old.learner
    assert (learner.optimizer.lr, learner.loss.clip_high, learner.compute.micro_batch_tokens,
            learner.checkpoints.every, learner.batch.prompts_per_step) == (3e-4, 0.3, 512, 3, 8)
    assert "learner.clip_high is now learner.loss.clip_high" in caplog.text
    # A preset in the old form extending one in the new form: the child's old key still wins over its base.
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {CONFIG_DIR / 'tiny-cpu.yaml'}\nlearner:\n  lr: 0.01\n  checkpoint_every: 7\n")
    assert (load_settings(child).learner.optimizer.lr, load_settings(child).learner.checkpoints.every) == (0.01, 7)
    # The old environment variable beats the preset's new key; --set beats both.
    monkeypatch.setenv("DAPO_LEARNER__LR", "0.02")
    assert load_settings("tiny-cpu").learner.optimizer.lr == 0.02
    assert load_settings("tiny-cpu", learner={"optimizer": {"lr": 0.03}}).learner.optimizer.lr == 0.03
    # An error names the key the user wrote, and where.
    with pytest.raises(ConfigError, match=r"learner.loss.clip_high: .*\(from --set learner.clip_high\)"):
        load_settings("tiny-cpu", origin="--set", learner={"clip_high": "wide"})


def test_the_32b_recipe_shards_its_learner_with_the_trainers_own_fsdp_and_the_others_do_not():
    assert load_settings("dapo-qwen2.5-32b").learner.compute.fsdp  # 16 ranks of 80 GB
    assert not load_settings("dapo-qwen2.5-math-1.5b").learner.compute.fsdp  # one GPU
    compute = load_settings("tiny-cpu").learner.compute
    assert (compute.fsdp, compute.fsdp_shard_ranks, compute.fsdp_offload, compute.gradient_sync) == (
        False, None, False, "micro_batch")
    with pytest.raises(ConfigError, match="fsdp_shard_ranks"):
        load_settings("tiny-cpu", learner={"compute": {"fsdp_shard_ranks": 0}})


def test_a_cpu_list_base_or_file_that_cannot_be_used_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="a CPU list such as `0-3,8`, got '0-1,x'"):
        load_settings(cpus={"learner": "0-1,x"})  # before `dapo run` starts Redis, not a traceback after
    assert load_settings(cpus={"learner": "0-3, 8", "reward": "auto"}).cpus.learner == "0-3, 8"
    (tmp_path / "base.yaml").write_text("base: 5\n")
    with pytest.raises(ConfigError, match="`base:` names a preset or a YAML file, got 5"):
        load_settings(tmp_path / "base.yaml")
    (tmp_path / "bytes.yaml").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="cannot be read as a UTF-8 YAML file"):
        load_settings(tmp_path / "bytes.yaml")


def test_a_section_variable_with_one_underscore_is_named_with_the_one_meant(monkeypatch, caplog):
    monkeypatch.setenv("DAPO_REDIS_URL", "redis://elsewhere:6379/0")  # one underscore: no field, Redis embedded
    monkeypatch.setenv("DAPO_DATA_DIR", "/data")  # the process's own variable: nothing to say
    with caplog.at_level("WARNING", logger="services.config"):
        assert load_settings().redis.url is None
    said = [r.getMessage() for r in caplog.records]
    assert said == ["DAPO_REDIS_URL sets nothing (DAPO_REDIS__URL; a section's field takes two underscores)"]


@pytest.mark.parametrize("variable, meant", [
    ("DAPO_LEARNER_LOSS__CLIP_HIGH", "DAPO_LEARNER__LOSS__CLIP_HIGH"),  # a section run into its parent
    ("DAPO_LEARNER_CLIP_HIGH", "DAPO_LEARNER__LOSS__CLIP_HIGH"),  # an old flat key, with one underscore
    # (a path through a known section to no field is refused already: `unknown key`)
    ("DAPO_LERNER__LOSS__CLIP_HIGH", "no setting lerner.loss.clip_high"),
    ("DAPO_TOKEN_SHA265", "DAPO_TOKEN_SHA256"), ("DAPO_WEIGHT_TOKEN", "DAPO_WEIGHTS_TOKEN")])
def test_a_variable_that_sets_nothing_is_named_with_what_it_likely_meant(monkeypatch, caplog, variable, meant):
    """pydantic-settings ignores a DAPO_ variable that names no field: an ablation set through the environment
    (a clip, a learning rate) ran with the preset's value and said nothing."""
    monkeypatch.setenv(variable, "0.2")
    for own in ("DAPO_CONFIG", "DAPO_WORKER_ID", "DAPO_LOG_DIR", "DAPO_TOKEN_FILE", "DAPO_RUN", "DAPO_RUN_DIR",
                "DAPO_LEARNER__LOSS__CLIP_LOW", "DAPO_LEARNER__REPORT_TO"):
        monkeypatch.setenv(own, "[]" if own.endswith("REPORT_TO") else "0.2" if "CLIP" in own else "x")
    with caplog.at_level("WARNING", logger="services.config"):
        load_settings("tiny-cpu")
    assert [r.getMessage() for r in caplog.records] == [f"{variable} sets nothing ({meant}; a section's field takes "
                                                        "two underscores)"]


@pytest.mark.parametrize("section, sampling, refusal", [
    ("eval_sampling", {"temperature": 0.0}, "n = 4 greedy samples"),  # greedy evaluation wants n: 1
    ("sampling", {"temperature": 2.5}, "temperature 2.5 is outside [0, 2.0]"),
    ("sampling", {"temperature": 0.001}, "temperature 0.001 is below 0.01 and not 0"),
])
def test_sampling_every_task_would_be_refused_for_is_refused_at_load(section, sampling, refusal):
    with pytest.raises(ConfigError, match=f"{section}: {re.escape(refusal)}"):
        load_settings(**{section: sampling})
    assert load_settings(eval_sampling={"temperature": 0.0, "n": 1}).eval_sampling.n == 1


@pytest.mark.parametrize("template, error", [("no slot", "has no {problem}"), ("\\boxed{} {problem}", "literal brace"),
                                             ("{other} {problem}", "one field")])
def test_a_raw_template_without_its_one_problem_field_is_refused_at_load(template, error):
    """Without {problem} every prompt was the same text; a stray brace failed at the first prompt, after the model
    had loaded."""
    with pytest.raises(ConfigError, match=re.escape(error)):
        load_settings("tiny-cpu", data={"raw_template": template})
    assert load_settings("tiny-cpu", data={"raw_template": "{{ {problem} }}"}).data.raw_template


@pytest.mark.parametrize("override, field", [
    ({"sampling": {"top_p": 0}}, "sampling.top_p"),
    ({"sampling": {"n": 0}}, "sampling.n"),
    ({"eval_sampling": {"max_tokens": 0}}, "eval_sampling.max_tokens"),
    ({"learner": {"loss": {"clip_low": 1.0}}}, "learner.loss.clip_low"),
    ({"learner": {"loss": {"clip_high": -0.1}}}, "learner.loss.clip_high"),
    ({"learner": {"loss": {"dual_clip": 0.5}}}, "learner.loss.dual_clip"),
    ({"learner": {"batch": {"epochs": 0}}}, "learner.batch.epochs"),
    ({"learner": {"batch": {"mini_batches": 0}}}, "learner.batch.mini_batches"),
    ({"learner": {"batch": {"prompts_per_step": 0}}}, "learner.batch.prompts_per_step"),
    ({"learner": {"batch": {"max_refills": -1}}}, "learner.batch.max_refills"),
    ({"learner": {"optimizer": {"lr": -1e-6}}}, "learner.optimizer.lr"),
    ({"reward": {"overlong_penalty": -1}}, "reward.overlong_penalty"),
    ({"learner": {"loss": {"adv_eps": 0}}}, "learner.loss.adv_eps"),  # an all-equal group: 0/0
    # From "0 = unlimited" guesses: every task dead-lettered at its first read (the run then "finished" with no
    # update), live tasks taken from their generator at every read, a learner that never pushes, a crash-looping
    # generator, every /v1/score refused, every importance weight capped below 1
    ({"streams": {"max_deliveries": 0}}, "streams.max_deliveries"),
    ({"streams": {"visibility_timeout_s": 0}}, "streams.visibility_timeout_s"),
    ({"streams": {"high_water": 0}}, "streams.high_water"),
    ({"streams": {"produce_timeout_s": 0}}, "streams.produce_timeout_s"),
    ({"generator": {"tasks_per_batch": 0}}, "generator.tasks_per_batch"),
    ({"reward": {"max_batch": 0}}, "reward.max_batch"),
    ({"max_body_mb": 0}, "max_body_mb"),
    ({"learner": {"loss": {"tis_cap": 0.2}}}, "learner.loss.tis_cap"),
])
def test_a_value_no_step_could_use_is_refused_when_loaded_not_at_the_first_update(override, field):
    """Refused by the config (exit 2, naming the field) instead of after a step's generation: a task message would
    refuse the sampling, the loss would raise in train_step and quarantine the batch's good groups."""
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_settings("tiny-cpu", **override)


def test_null_from_the_environment_unsets_a_field_that_may_be_null(monkeypatch):
    monkeypatch.setenv("DAPO_LEARNER__LOSS__TIS_CAP", "null")
    monkeypatch.setenv("DAPO_LEARNER__LOSS__DUAL_CLIP", "null")
    loss = load_settings("dapo-qwen2.5-32b").learner.loss
    assert loss.tis_cap is None and loss.dual_clip is None


@pytest.mark.parametrize("argument", ["--generators", "--reward-workers", "--learner-procs"])
def test_a_run_without_a_process_of_a_kind_is_refused_as_usage(argument, capsys):
    """With no generator (or reward worker) a run could never train, and nothing would say why."""
    from cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", argument, "0"])
    assert exit_.value.code == 2 and f"argument {argument}: 0 is not at least 1" in capsys.readouterr().err


def test_the_plan_suggests_no_change_the_settings_would_refuse():
    """FSDP has no loss scaling, so float16 under FSDP is refused: the plan proposed it to a float16 model."""
    from learner.plan import changes_to_try

    suggested = [change.what for change in changes_to_try(load_settings("tiny-cpu", model={"dtype": "float16"}), 4, 2)]
    assert suggested and "learner.compute.fsdp: true" not in suggested
    assert "learner.compute.fsdp: true" in [change.what for change in changes_to_try(load_settings("tiny-cpu"), 4, 2)]
