"""`qwen-kvprep template`: the rendered files parse, and every qwen-kvprep command line in
them is accepted by the real CLI (so a renamed option breaks this test, not a deployment)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest
import yaml

from qwen_kvprep.cli import cli
from qwen_kvprep.templating import TEMPLATES, render
from tests.cli import invoke, kvprep


def assert_cli_accepts(args: list[str]) -> None:
    """Parse `qwen-kvprep ARGS` with click exactly as the CLI would (no callback runs)."""
    assert args, "empty qwen-kvprep command line"
    command = cli.commands.get(args[0])
    assert command is not None, f"qwen-kvprep has no command {args[0]!r}"
    try:
        command.make_context(args[0], list(args[1:]))
    except click.ClickException as exc:
        pytest.fail(f"`qwen-kvprep {shlex.join(args)}` is rejected: {exc.format_message()}")


def dockerfile_command_lines(text: str) -> list[list[str]]:
    joined = re.sub(r"\\\n", " ", text)
    found: list[list[str]] = []
    for line in joined.splitlines():
        instr, _, rest = line.strip().partition(" ")
        if instr in ("ENTRYPOINT", "CMD") and rest.startswith("["):
            argv = json.loads(rest)
            if argv and argv[0] == "qwen-kvprep":
                found.append(argv[1:])
        elif instr == "RUN":
            for part in rest.split("&&"):
                argv = shlex.split(part)
                if argv and argv[0] == "qwen-kvprep":
                    found.append(argv[1:])
    return found


def final_stage_env(text: str) -> dict[str, str]:
    """The ENV variables the Dockerfile's last stage sets, as docker reads them."""
    joined = re.sub(r"\\\n", " ", text.split("\nFROM ")[-1])
    env: dict[str, str] = {}
    for line in joined.splitlines():
        instr, _, rest = line.strip().partition(" ")
        if instr == "ENV":
            for part in shlex.split(rest):
                key, _, value = part.partition("=")
                env[key] = value
    return env


def leftover_placeholders(text: str) -> list[str]:
    # template variables are lower case; $PATH, ${MODEL_DIR:-...}, "$@" are meant to stay
    return re.findall(r"\$\{?([a-z_][a-z0-9_]*)", text)


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
@pytest.mark.parametrize("view_dir", [None, "/srv/prepared/Qwen-7B-Chat"])
def test_every_template_renders_completely(kind: str, view_dir: str | None) -> None:
    text = render(kind, view_dir=view_dir)
    assert leftover_placeholders(text) == []
    assert "qwen-kvprep" in text


def test_dockerfile_builds_in_the_image_and_starts_with_prestart() -> None:
    text = render("docker", arch="7.0;8.0;9.0+PTX", model_dir="/models/Qwen-14B-Chat")
    froms = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert len(froms) == 2 and froms[0].endswith(" AS build")  # multi-stage
    commands = dockerfile_command_lines(text)
    assert [c[0] for c in commands] == ["build", "prestart"]
    assert commands[0][commands[0].index("--arch") + 1] == "7.0;8.0;9.0+PTX"
    for argv in commands:
        assert_cli_accepts(argv)
    # the cache built in the first stage is what the final image carries and points at
    cache = commands[0][commands[0].index("--cache-dir") + 1]
    assert f"COPY --from=build {cache} {cache}" in text
    assert f"QWEN_KVPREP_CACHE={cache}" in text.split("FROM ")[2]
    assert "QWEN_KVPREP_DIR=/models/Qwen-14B-Chat" in text
    assert 'ENTRYPOINT ["qwen-kvprep", "prestart", "--"]' in text


def test_dockerfile_installs_the_qwen_kvprep_the_user_has() -> None:
    """qwen-kvprep is not on PyPI: the image installs a wheel of the copy installed here,
    which the header says how to make (this checkout, installed editable for the tests)."""
    from qwen_kvprep.templating import installed_from, wheel_name

    text = render("docker")
    assert "qwen-kvprep==" not in text
    assert f"COPY {wheel_name()} /tmp/" in text
    assert f"pip install /tmp/{wheel_name()}" in text
    source = installed_from()
    assert source is not None and source[0] == "dir"
    assert Path(source[1]).resolve() == Path(__file__).resolve().parent.parent
    assert f"#   pip wheel --no-deps -w . {source[1]}\n" in text


def test_dockerfile_with_a_view_serves_from_it() -> None:
    text = render("docker", view_dir="/srv/prepared/Qwen-7B-Chat")
    assert final_stage_env(text)["QWEN_KVPREP_OUTPUT"] == "/srv/prepared/Qwen-7B-Chat"
    cmd = next(line for line in text.splitlines() if line.startswith("CMD "))
    assert json.loads(cmd[4:])[-1] == "/srv/prepared/Qwen-7B-Chat"


@pytest.mark.parametrize("prebuilt", [None, "my-org/kernels"])
@pytest.mark.parametrize("model_dir", ["/models/Qwen-7B-Chat", "/models/Qwen-1.8B-Chat"])
def test_dockerfile_serves_its_read_only_run_example(
    prebuilt: str | None, model_dir: str
) -> None:
    """The header's `docker run -v …:ro` mounts the model read-only, so prestart must
    prepare a view in a folder of the container's own and the server must load that: a
    Dockerfile that left QWEN_KVPREP_OUTPUT unset failed its own example (prestart: `… is
    on a read-only file system`)."""
    text = render("docker", model_dir=model_dir, prebuilt=prebuilt)
    run = next(line for line in text.splitlines() if line.startswith("#   docker run "))
    mount = shlex.split(run)[shlex.split(run).index("-v") + 1]
    _, inside, mode = mount.split(":")
    assert mode == "ro"
    env = final_stage_env(text)
    assert env["QWEN_KVPREP_DIR"] == inside == model_dir
    view = env["QWEN_KVPREP_OUTPUT"]
    assert view.startswith("/") and not view.startswith(inside + "/")
    assert "." not in Path(view).name  # transformers imports the model code by that name
    cmd = next(line for line in text.splitlines() if line.startswith("CMD "))
    assert json.loads(cmd[4:])[-1] == view


def test_entrypoint_execs_prestart_with_the_arguments(tmp_path: Path) -> None:
    text = render("entrypoint", model_dir="/models/Qwen-7B-Chat")
    line = next(x for x in text.splitlines() if x.startswith("exec qwen-kvprep"))
    argv = shlex.split(line)[2:]
    assert argv[0] == "prestart" and "--" in argv
    assert_cli_accepts(argv[: argv.index("--")])
    script = tmp_path / "entrypoint.sh"
    script.write_text(text)
    subprocess.run(["sh", "-n", str(script)], check=True)
    # Run it with a stand-in qwen-kvprep that prints how it was called.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    fake = fake_bin / "qwen-kvprep"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\nexit 3\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MODEL_DIR", None)
    res = subprocess.run(
        ["sh", str(script), "python3", "-m", "srv", "--name", "a b"],
        capture_output=True, text=True, env=env,
    )
    assert res.returncode == 3  # exec: the exit code is the command's own
    assert res.stdout.split("\n")[:-1] == [
        "[prestart]", "[/models/Qwen-7B-Chat]", "[--]",
        "[python3]", "[-m]", "[srv]", "[--name]", "[a b]",
    ]
    env["MODEL_DIR"] = "/elsewhere/Model"
    res = subprocess.run(["sh", str(script)], capture_output=True, text=True, env=env)
    assert res.stdout.split("\n")[:-1] == ["[prestart]", "[/elsewhere/Model]", "[--]"]


def test_k8s_manifest_prepares_a_view_in_an_init_container() -> None:
    text = render("k8s", model_dir="/models/Qwen-7B-Chat", image="reg.example/qwen:1",
                  arch="8.0;9.0", replicas=3)
    docs = list(yaml.safe_load_all(text))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"PersistentVolumeClaim", "Deployment"}
    assert kinds["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    deploy = kinds["Deployment"]
    assert deploy["spec"]["replicas"] == 3
    pod = deploy["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["prepared"]
    assert volumes["model"]["persistentVolumeClaim"]["readOnly"] is True
    assert volumes["build-cache"]["persistentVolumeClaim"]["claimName"] == (
        kinds["PersistentVolumeClaim"]["metadata"]["name"]
    )
    (init,) = pod["initContainers"]
    (server,) = pod["containers"]
    assert init["image"] == server["image"] == "reg.example/qwen:1"
    assert init["command"][:2] == ["qwen-kvprep", "fix"]
    assert_cli_accepts(init["command"][1:])
    view_dir = init["command"][init["command"].index("--output") + 1]
    assert "." not in Path(view_dir).name
    assert server["command"][:2] == ["qwen-kvprep", "prestart"]
    assert server["command"][-1] == "--"
    assert_cli_accepts(server["command"][1:-1])
    assert server["args"][-1] == view_dir  # the server loads the view, not the volume
    # both containers see the same view, build cache and modules cache
    for c in (init, server):
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert view_dir.startswith(mounts["prepared"] + "/")
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["HF_MODULES_CACHE"].startswith(mounts["prepared"] + "/")
        assert c["command"][c["command"].index("--cache-dir") + 1] == mounts["build-cache"]
        model_mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
        assert model_mount["readOnly"] is True


@pytest.mark.parametrize(
    ("kind", "option", "value"),
    [("docker", "model_dir", "/models/x; rm -rf /"), ("docker", "arch", '8.0"\nRUN evil'),
     ("docker", "image", "a b"), ("docker", "model_dir", "relative/path"),
     # the entrypoint serves the model folder itself (docker and k8s serve a view)
     ("entrypoint", "model_dir", "/models/Qwen-1.8B-Chat")],
)
def test_unsafe_or_unloadable_values_are_refused(kind: str, option: str, value: str) -> None:
    from qwen_kvprep.errors import UsageError

    with pytest.raises(UsageError):
        render(kind, **{option: value})


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cuda", "abc"], "--cuda 'abc' is not a CUDA version like 12.4.1"),
        (["--cuda", "12"], "--cuda '12' is not a CUDA version like 12.4.1"),
        (["--torch", "abc"], "--torch 'abc' is not a version number like 2.5.1"),
        (["--arch", ""], "--arch: the architecture list is empty"),
        (["--arch", "abc"], "--arch: 'abc' is not a GPU architecture"),
        (["--model-dir", "relative/path"], "--model-dir 'relative/path' is a relative path"),
        (["--view-dir", "prepared/x"], "--view-dir 'prepared/x' is a relative path"),
        (["--cache-dir", "cache"], "--cache-dir 'cache' is a relative path"),
        (["--name", "Qwen_7B"], "--name 'Qwen_7B' is not a DNS-1123 name"),
        (["--prebuilt", "kernels"], "--prebuilt 'kernels' is neither a Hub repo"),
    ],
)
def test_refused_values_say_what_is_wrong(args: list[str], says: str) -> None:
    res = invoke("template", "docker", *args)
    assert res.returncode == 2, res.stderr
    first = res.stderr.splitlines()[0]
    assert first.startswith(f"error: {says}"), res.stderr
    assert "cannot hold unquoted" not in first and "fix: " in res.stderr


def test_arch_is_written_as_build_reads_it() -> None:
    """--arch takes what build takes (commas, sm_80, torch's family names) and writes the
    list build and QWEN_KVPREP_ARCH read as the same one."""
    text = render("docker", arch="sm_80,Hopper 8.6")
    (build,) = [c for c in dockerfile_command_lines(text) if c[0] == "build"]
    assert build[build.index("--arch") + 1] == "8.0;8.6;9.0+PTX"
    assert final_stage_env(text)["QWEN_KVPREP_ARCH"] == "8.0;8.6;9.0+PTX"
    assert_cli_accepts(build)


def test_output_in_a_missing_folder_is_a_usage_error(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "Dockerfile"
    res = invoke("template", "docker", "-o", str(target))
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines()[0] == (
        f"error: --output {target}: the folder {target.parent} does not exist"
    )
    assert ".tmp" not in res.stderr and not target.parent.exists()


@pytest.mark.parametrize("what", ["fifo", "link-to-file", "link-to-device"])
def test_output_that_is_not_a_regular_file_is_refused_and_left_alone(
    tmp_path: Path, what: str
) -> None:
    # the write replaces what is there: as root, `-o /dev/full` replaced the device node
    target = tmp_path / "Dockerfile"
    if what == "fifo":
        os.mkfifo(target)
    elif what == "link-to-file":
        (tmp_path / "real").write_text("mine\n")
        target.symlink_to(tmp_path / "real")
    else:
        target.symlink_to(os.devnull)  # what /dev/stdout is: a link
    before = os.lstat(target)
    res = invoke("template", "docker", "-o", str(target))
    assert res.returncode == 2, res.stderr
    first = res.stderr.splitlines()[0]
    assert first.startswith(f"error: --output {target} is a ") and "not a regular file" in first
    assert "leave out -o" in res.stderr
    after = os.lstat(target)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    if what == "link-to-file":
        assert (tmp_path / "real").read_text() == "mine\n"


def test_a_failed_write_names_the_file_not_its_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from qwen_kvprep import templating
    from qwen_kvprep.errors import KvprepError

    target = tmp_path / "Dockerfile"

    def fails(path: str, text: str, mode: object = None) -> None:
        raise OSError(errno.EIO, "Input/output error", str(tmp_path / ".Dockerfile.x1.tmp"))

    monkeypatch.setattr(templating, "atomic_write_text", fails)
    with pytest.raises(KvprepError) as err:
        templating.write(str(target), "docker", "FROM scratch\n")
    assert str(target) in err.value.message and ".tmp" not in err.value.message


def test_template_command_prints_and_writes(tmp_path: Path) -> None:
    res = kvprep("template", "k8s", "--model-dir", "/models/Qwen-7B-Chat")
    assert res.returncode == 0, res.stderr
    assert list(yaml.safe_load_all(res.stdout))
    out = tmp_path / "entrypoint.sh"
    res = kvprep("template", "entrypoint", "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    assert out.read_text().startswith("#!/bin/sh")
    assert os.access(out, os.X_OK)
    res = kvprep("template", "docker", "--image", "bad image")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
