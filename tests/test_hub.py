"""`--source hub` against a fake Hub on 127.0.0.1: good files, bad bodies, HTTP errors, a
server that is down, offline mode. Every failure must leave the checkpoint untouched.

The fake answers what hf_hub_download asks (huggingface_hub < 1.0, file_download.py): a
HEAD on `/{repo}/resolve/{revision}/{file}` that must carry X-Repo-Commit, an ETag and a
Content-Length, then a GET on the same URL for the body. Errors carry X-Error-Code the way
the Hub does, which is how huggingface_hub tells a missing repo from a missing file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional
from urllib.parse import unquote

import huggingface_hub
import huggingface_hub.utils as hf_utils
import pytest
from huggingface_hub import file_download
from huggingface_hub.utils import _http as hf_http
from packaging.version import Version

from qwen_kvprep import catalogue
from qwen_kvprep.errors import SourceError, UsageError
from qwen_kvprep.findings import Finding, Severity
from qwen_kvprep.journal.writer import Journal
from qwen_kvprep.resources import KERNEL_FILES
from qwen_kvprep.steps import sources
from qwen_kvprep.steps.context import FixContext, FixOptions
from tests import needs
from tests.cli import document, kvprep
from tests.hf_settings import set_hf_constant
from tests.treesnap import snapshot

# huggingface_hub < 1.0 keeps one requests session per thread; 1.x and later one httpx client
reset_sessions = getattr(hf_utils, "reset_sessions", None) or hf_utils.close_session

CPP_NAME, CU_NAME = KERNEL_FILES
# Stand-ins for Qwen's files (which cannot be shipped); the known-good list is swapped for
# their hashes in every test here.
CPP = b"// stand-in for the official binding file\n" + b"int x;\n" * 40
CU = b"// stand-in for the official kernel file\n" + bytes(range(256)) * 8
GOOD = {CPP_NAME: CPP, CU_NAME: CU}
REPO = "Qwen/Qwen-7B-Chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HTML = b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>proxy</body></html>\n"

# The back-off waits of huggingface_hub's own retries when the HEAD request gets a 5xx or
# no connection: 5 retries from 0.31 on, none before (0.19 to 0.30 try once).
HUB_RETRIES = [1, 2, 4, 8, 8] if Version(huggingface_hub.__version__) >= Version("0.31") else []

_ROUTE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>[^?]+)")
# What snapshot_download asks first: the repo's file list at a revision (HfApi.repo_info).
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>[^/?]+)")
# What huggingface_hub >= 1.x's snapshot_download asks next: the file tree at that commit.
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/?]+)")


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    claimed_length: Optional[int] = None  # a Content-Length that lies about the body


class FakeHub:
    def __init__(self) -> None:
        self.routes: dict[tuple[str, str, str], Reply] = {}
        self.requests: list[tuple[str, str]] = []
        self.sleeps: list[float] = []  # huggingface_hub's back-off waits, not slept
        self.endpoint = ""
        self.listings: dict[tuple[str, str], list[str]] = {}
        self._lock = threading.Lock()

    def serve(self, files: dict[str, bytes], repo: str = REPO, revision: str = "main") -> None:
        for name, body in files.items():
            self.routes[(repo, revision, name)] = Reply(
                200,
                body,
                {"ETag": f'"{hashlib.sha256(body).hexdigest()}"', "X-Repo-Commit": COMMIT},
            )

    def serve_repo(self, files: dict[str, bytes], repo: str = REPO) -> None:
        """A whole repo for snapshot_download: its file list and every file, at `main`
        and at the commit `main` resolves to."""
        for revision in ("main", COMMIT):
            self.serve(files, repo, revision)
            self.listings[(repo, revision)] = sorted(files)

    def reply_for(self, path: str) -> Reply:
        api = _API.match(path)
        if api is not None:
            names = self.listings.get((unquote(api["repo"]), unquote(api["rev"])))
            if names is None:
                return Reply(401, b"Repository not found", {"X-Error-Code": "RepoNotFound"})
            body = json.dumps(
                # fields the real Hub always sends and huggingface_hub 0.19 requires
                {"id": unquote(api["repo"]), "sha": COMMIT, "private": False,
                 "downloads": 0, "likes": 0, "tags": [],
                 "siblings": [{"rfilename": n} for n in names]}
            ).encode()
            return Reply(200, body, {"Content-Type": "application/json"})
        tree = _TREE.match(path)
        if tree is not None:
            repo, rev = unquote(tree["repo"]), unquote(tree["rev"])
            names = self.listings.get((repo, rev))
            if names is None:
                return Reply(401, b"Repository not found", {"X-Error-Code": "RepoNotFound"})
            entries = [
                {"type": "file", "path": n, "size": len(self.routes[(repo, rev, n)].body),
                 "oid": hashlib.sha1(self.routes[(repo, rev, n)].body).hexdigest()}
                for n in names if (repo, rev, n) in self.routes
            ]
            return Reply(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})
        m = _ROUTE.match(path)
        if m is None:
            return Reply(404, b"not a resolve URL")
        key = (unquote(m["repo"]), unquote(m["rev"]), unquote(m["file"]))
        reply = self.routes.get(key)
        if reply is not None:
            return reply
        # What the Hub says about an unknown repo to an anonymous client.
        return Reply(401, b"Repository not found", {"X-Error-Code": "RepoNotFound"})

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))


class _Handler(BaseHTTPRequestHandler):
    server: Any

    def _answer(self, with_body: bool) -> None:
        fake: FakeHub = self.server.fake
        fake.record(self.command, self.path)
        reply = fake.reply_for(self.path)
        self.send_response(reply.status)
        length = reply.claimed_length if reply.claimed_length is not None else len(reply.body)
        self.send_header("Content-Length", str(length))
        for key, value in reply.headers.items():
            self.send_header(key, value)
        self.send_header("Connection", "close")
        self.end_headers()
        if with_body:
            self.wfile.write(reply.body)
        self.close_connection = True

    def do_HEAD(self) -> None:
        self._answer(with_body=False)

    def do_GET(self) -> None:
        self._answer(with_body=True)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _point_hf_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, cache: Path) -> None:
    """What HF_ENDPOINT / HF_HUB_CACHE would do had they been set before huggingface_hub
    was imported (it reads them at import; the CLI test below sets the real variables)."""
    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    set_hf_constant(monkeypatch, "ENDPOINT", endpoint)
    set_hf_constant(monkeypatch, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    set_hf_constant(monkeypatch, "HF_HUB_CACHE", str(cache))
    set_hf_constant(monkeypatch, "HF_HUB_OFFLINE", False)
    set_hf_constant(monkeypatch, "HF_TOKEN_PATH", str(cache.parent / "no-token"))
    # huggingface_hub 0.19 reads the token through HfFolder, whose token paths (the current
    # one and the old ~/.huggingface/token) were fixed when it was imported
    folder = getattr(hf_utils, "HfFolder", None)
    for attr in ("path_token", "_old_path_token"):
        if isinstance(getattr(folder, attr, None), Path):
            monkeypatch.setattr(folder, attr, cache.parent / f"no-token-{attr}")


@pytest.fixture()
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.fake = fake  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    fake.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    _point_hf_at(monkeypatch, fake.endpoint, tmp_path / "hf-cache")
    # huggingface_hub may retry with back-off (HUB_RETRIES): keep the waits (to assert on
    # them) but do not spend them.
    monkeypatch.setattr(hf_http, "time", SimpleNamespace(sleep=fake.sleeps.append))
    monkeypatch.setattr(file_download, "time", SimpleNamespace(sleep=fake.sleeps.append))
    reset_sessions()
    yield fake
    server.shutdown()
    server.server_close()
    reset_sessions()


@pytest.fixture(autouse=True)
def test_known_good(monkeypatch: pytest.MonkeyPatch) -> None:
    files = {
        name: catalogue.KnownFile(name, hashlib.sha256(body).hexdigest(), len(body))
        for name, body in GOOD.items()
    }
    monkeypatch.setattr(catalogue, "known_good", lambda: catalogue.KnownGood(files, (REPO,)))
    # A torch that still compiles the official sources: compatibility is tested apart.
    monkeypatch.setattr(sources, "_torch_info", lambda: ("2.5.1", "12.4"))


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "Qwen-7B-Chat"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen"}\n')
    (d / "modeling_qwen.py").write_text("# remote code\n")
    return d


def run_hub(directory: Path, **options: Any) -> FixContext:
    options.setdefault("progress", False)
    opts = FixOptions(source="hub", smoke=False, **options)
    ctx = FixContext(directory, opts, Journal(directory, dry_run=opts.dry_run))
    sources.run(ctx)
    return ctx


def refused(directory: Path, **options: Any) -> Finding:
    """Run, expect a SourceError with one finding, and check nothing changed."""
    before = snapshot(directory)
    with pytest.raises(SourceError) as info:
        run_hub(directory, **options)
    assert snapshot(directory) == before
    findings = info.value.findings
    assert len(findings) == 1, findings
    assert findings[0].severity is Severity.FAIL
    return findings[0]


# -- good files ----------------------------------------------------------------------------
def test_good_files_are_fetched_verified_and_written(fake_hub: FakeHub, ckpt: Path) -> None:
    fake_hub.serve(GOOD)
    ctx = run_hub(ckpt, repo_id=REPO)
    assert (ckpt / CPP_NAME).read_bytes() == CPP
    assert (ckpt / CU_NAME).read_bytes() == CU
    s = ctx.sources
    assert (s.origin, s.kind, s.repo_id, s.revision, s.commit) == (
        "hub",
        catalogue.OFFICIAL,
        REPO,
        "main",
        COMMIT,
    )
    assert dict(s.files) == GOOD
    done = [f for f in ctx.findings if f.id == "kernels.sources"]
    assert done and done[0].severity is Severity.OK
    assert REPO in done[0].message and "verified" in done[0].message
    assert ctx.extra["sources"]["files"][CPP_NAME] == hashlib.sha256(CPP).hexdigest()
    # the journal kept "absent" originals, so revert removes them again
    assert ctx.journal.changed_files == sorted(KERNEL_FILES)
    assert {m for m, _ in fake_hub.requests} == {"HEAD", "GET"}


def test_dry_run_verifies_but_writes_nothing(fake_hub: FakeHub, ckpt: Path) -> None:
    fake_hub.serve(GOOD)
    before = snapshot(ckpt)
    ctx = run_hub(ckpt, repo_id=REPO, dry_run=True)
    assert snapshot(ckpt) == before
    assert sorted(p.path.name for p in ctx.journal.planned) == sorted(KERNEL_FILES)
    assert "would write" in ctx.findings[-1].message


def test_revision_option_is_used(fake_hub: FakeHub, ckpt: Path) -> None:
    fake_hub.serve(GOOD, revision="v1.0")
    ctx = run_hub(ckpt, repo_id=REPO, revision="v1.0")
    assert ctx.sources.revision == "v1.0"
    assert all("/resolve/v1.0/" in path for _, path in fake_hub.requests)


@pytest.mark.parametrize(("progress", "bars_off"), [(False, True), (True, False)])
def test_progress_bars_only_when_wanted(
    fake_hub: FakeHub, ckpt: Path, monkeypatch: pytest.MonkeyPatch, progress: bool, bars_off: bool
) -> None:
    import huggingface_hub
    from huggingface_hub.utils import are_progress_bars_disabled

    if are_progress_bars_disabled():
        needs.skip("env", "HF_HUB_DISABLE_PROGRESS_BARS is set for this run")
    seen: list[bool] = []
    real = huggingface_hub.hf_hub_download

    def spy(*args: Any, **kwargs: Any) -> str:
        seen.append(are_progress_bars_disabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    fake_hub.serve(GOOD)
    run_hub(ckpt, repo_id=REPO, progress=progress)
    assert seen == [bars_off, bars_off]
    assert not are_progress_bars_disabled()  # the user's setting is back


# -- bad bodies ----------------------------------------------------------------------------
def test_html_page_is_refused_and_described(fake_hub: FakeHub, ckpt: Path) -> None:
    fake_hub.serve({CPP_NAME: HTML, CU_NAME: CU})
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.verify"
    assert "HTML page" in f.message and CPP_NAME in f.message
    assert f.details["received_size"] == len(HTML)
    assert f.details["received_sha256"] == hashlib.sha256(HTML).hexdigest()
    assert f.details["received_head"] == repr(HTML[:32])
    assert f.details["received_head"].startswith("b'<!DOCTYPE html>")
    assert f.details["expected_sha256"] == hashlib.sha256(CPP).hexdigest()
    assert "--source vendored" in (f.fix or "")


def test_different_file_of_right_length_is_refused(fake_hub: FakeHub, ckpt: Path) -> None:
    tampered = CU[:-1] + b"!"
    fake_hub.serve({CPP_NAME: CPP, CU_NAME: tampered})
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.verify"
    assert "not the official file" in f.message
    assert f.details["received_size"] == len(CU)
    assert f.details["received_sha256"] == hashlib.sha256(tampered).hexdigest()


def test_truncated_body_with_its_own_length_is_refused(fake_hub: FakeHub, ckpt: Path) -> None:
    # A proxy that cut the file and sent honest headers for what it kept.
    fake_hub.serve({CPP_NAME: CPP[:100], CU_NAME: CU})
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.verify"
    assert f.details["received_size"] == 100


def test_body_shorter_than_content_length_is_a_fetch_error(fake_hub: FakeHub, ckpt: Path) -> None:
    fake_hub.serve(GOOD)
    reply = fake_hub.routes[(REPO, "main", CPP_NAME)]
    reply.claimed_length = len(CPP)
    reply.body = CPP[:50]  # the connection closes after 50 of the announced bytes
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.fetch"
    assert (f.details["repo_id"], f.details["file"], f.details["revision"]) == (
        REPO,
        CPP_NAME,
        "main",
    )


# -- HTTP errors -----------------------------------------------------------------------------
def test_missing_file_404(fake_hub: FakeHub, ckpt: Path) -> None:
    fake_hub.serve(GOOD)
    fake_hub.routes[(REPO, "main", CPP_NAME)] = Reply(
        404, b"Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}
    )
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.fetch"
    assert f.details["status"] == 404
    assert f"has no {CPP_NAME}" in f.message
    assert (f.details["repo_id"], f.details["file"], f.details["revision"]) == (
        REPO,
        CPP_NAME,
        "main",
    )


def test_unknown_repo(fake_hub: FakeHub, ckpt: Path) -> None:
    f = refused(ckpt, repo_id="Qwen/No-Such-Repo")
    assert f.id == "kernels.fetch"
    assert "Qwen/No-Such-Repo was not found" in f.message
    assert REPO in (f.fix or "")  # lists the known repos


def test_gated_repo_403(fake_hub: FakeHub, ckpt: Path) -> None:
    fake_hub.routes[(REPO, "main", CPP_NAME)] = Reply(403, b"gated", {"X-Error-Code": "GatedRepo"})
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.fetch"
    assert "gated" in f.message and f.details["status"] == 403
    assert "HF_TOKEN" in (f.fix or "")


def test_server_error_500_after_hubs_retries(fake_hub: FakeHub, ckpt: Path) -> None:
    fake_hub.routes[(REPO, "main", CPP_NAME)] = Reply(500, b"boom")
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.fetch"
    assert f.details["status"] == 500
    assert "500" in f.message and fake_hub.endpoint in f.message
    # huggingface_hub's own retry policy ran (1 try + its retries); we added none.
    # (newer releases ask once more, without back-off, before giving up on a file with no
    # cached copy)
    again = 1 if hasattr(file_download, "_ETAG_RETRY_TIMEOUT") else 0
    assert [m for m, _ in fake_hub.requests] == ["HEAD"] * (1 + len(HUB_RETRIES) + again)
    assert fake_hub.sleeps == HUB_RETRIES


def test_server_error_uses_a_cached_copy(fake_hub: FakeHub, ckpt: Path, tmp_path: Path) -> None:
    fake_hub.serve(GOOD)
    other = tmp_path / "other"
    other.mkdir()
    run_hub(other, repo_id=REPO)  # fills the huggingface_hub cache
    for name in KERNEL_FILES:
        fake_hub.routes[(REPO, "main", name)] = Reply(500, b"boom")
    ctx = run_hub(ckpt, repo_id=REPO)
    assert (ckpt / CU_NAME).read_bytes() == CU
    assert ctx.sources.commit == COMMIT


def test_server_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ckpt: Path) -> None:
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    _point_hf_at(monkeypatch, endpoint, tmp_path / "hf-cache")
    sleeps: list[float] = []
    monkeypatch.setattr(hf_http, "time", SimpleNamespace(sleep=sleeps.append))
    reset_sessions()
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.fetch"
    assert "could not get" in f.message
    # requests' error before huggingface_hub 1.0, httpx's after
    assert "ConnectionError" in f.message or "ConnectError" in f.message
    assert f.details["endpoint"] == endpoint
    assert sleeps == HUB_RETRIES  # huggingface_hub retried (or not), we did not


# -- offline -----------------------------------------------------------------------------------
def test_offline_without_cached_copy(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch, ckpt: Path
) -> None:
    fake_hub.serve(GOOD)
    set_hf_constant(monkeypatch, "HF_HUB_OFFLINE", True)
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.fetch"
    assert "HF_HUB_OFFLINE" in f.message
    assert "--source vendored" in (f.fix or "")
    assert f.details["offline"] is True
    assert fake_hub.requests == []  # not even an attempt


def test_offline_with_cached_copy(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch, ckpt: Path, tmp_path: Path
) -> None:
    fake_hub.serve(GOOD)
    other = tmp_path / "other"
    other.mkdir()
    run_hub(other, repo_id=REPO)
    seen = len(fake_hub.requests)
    set_hf_constant(monkeypatch, "HF_HUB_OFFLINE", True)
    ctx = run_hub(ckpt, repo_id=REPO)
    assert len(fake_hub.requests) == seen
    assert (ckpt / CPP_NAME).read_bytes() == CPP
    assert ctx.sources.origin == "hub"


def test_offline_cached_copy_is_still_verified(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch, ckpt: Path, tmp_path: Path
) -> None:
    fake_hub.serve({CPP_NAME: HTML, CU_NAME: CU})
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(SourceError):
        run_hub(other, repo_id=REPO)  # the HTML page is now in the huggingface_hub cache
    set_hf_constant(monkeypatch, "HF_HUB_OFFLINE", True)
    f = refused(ckpt, repo_id=REPO)
    assert f.id == "kernels.verify"
    # it names the cached blob, the file to delete
    assert Path(f.details["cached_path"]).read_bytes() == HTML


# -- where the repo comes from -----------------------------------------------------------------
def _snapshot(cache: Path) -> Path:
    snap = cache / "models--Qwen--Qwen-7B-Chat" / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"model_type": "qwen"}\n')
    return snap


def test_snapshot_dir_gives_repo_and_revision(fake_hub: FakeHub, tmp_path: Path) -> None:
    # The checkpoint is a snapshot of the very cache huggingface_hub downloads into, so
    # hf_hub_download links the files into it: those links must not stay behind.
    snap = _snapshot(tmp_path / "hf-cache")
    fake_hub.serve(GOOD, revision=COMMIT)
    ctx = run_hub(snap)
    assert (ctx.sources.repo_id, ctx.sources.revision) == (REPO, COMMIT)
    for name in KERNEL_FILES:
        assert not (snap / name).is_symlink()  # written by the journal, not linked
        assert (snap / name).read_bytes() == GOOD[name]
    assert ctx.journal.changed_files == sorted(KERNEL_FILES)
    # they were absent before fix, so revert removes them (it would bring back links had
    # huggingface_hub's links been left for the journal to find)
    ctx.journal.revert()
    assert not any(os.path.lexists(snap / name) for name in KERNEL_FILES)


def test_snapshot_dir_left_unchanged_on_refusal(fake_hub: FakeHub, tmp_path: Path) -> None:
    snap = _snapshot(tmp_path / "hf-cache")
    fake_hub.serve({CPP_NAME: HTML, CU_NAME: CU}, revision=COMMIT)
    f = refused(snap)
    assert f.id == "kernels.verify"


def test_hub_needs_a_repo_id(ckpt: Path) -> None:
    before = snapshot(ckpt)
    with pytest.raises(UsageError) as info:
        run_hub(ckpt)
    assert "--repo-id" in info.value.message
    assert REPO in (info.value.fix or "")
    assert snapshot(ckpt) == before


def test_malformed_repo_id(ckpt: Path) -> None:
    with pytest.raises(UsageError) as info:
        run_hub(ckpt, repo_id="not a repo//x")
    assert "not a Hub repo id" in info.value.message


def test_checkpoint_already_official_needs_no_network(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch, ckpt: Path
) -> None:
    for name, body in GOOD.items():
        (ckpt / name).write_bytes(body)
    set_hf_constant(monkeypatch, "HF_HUB_OFFLINE", True)
    ctx = run_hub(ckpt, repo_id=REPO)
    assert fake_hub.requests == []
    assert (ctx.sources.origin, ctx.sources.kind) == ("checkpoint", catalogue.OFFICIAL)
    assert ctx.journal.changed_files == []


# -- the real command, with the real environment variables --------------------------------------
def _cli(directory: Path, env: dict[str, str], *extra: str) -> tuple[int, dict[str, Any]]:
    res = kvprep("fix", str(directory), "--source", "hub", "--repo-id", REPO, "--no-build",
                 "--no-smoke", "--json", *extra, env=env, timeout=300,
                 cwd=Path(__file__).resolve().parents[1])
    return res.returncode, document(res)


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    tiny_mod = pytest.importorskip("qwen_kvprep.tiny")
    return Path(tiny_mod.generate_checkpoint(tmp_path / "tiny-qwen", layers=1, shards=1))


def test_cli_honours_hf_environment(fake_hub: FakeHub, tiny: Path, tmp_path: Path) -> None:
    fake_hub.serve({CPP_NAME: HTML, CU_NAME: HTML})  # the real list refuses anything we serve
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(
        HF_ENDPOINT=fake_hub.endpoint,
        HF_HOME=str(tmp_path / "cli-hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    before = snapshot(tiny)
    code, doc = _cli(tiny, env)
    assert code == 1 and doc["ok"] is False
    verify = [f for f in doc["findings"] if f["id"] == "kernels.verify"]
    assert {f["details"]["file"] for f in verify} == set(KERNEL_FILES)
    assert all(f["details"]["received_head"].startswith("b'<!DOCTYPE") for f in verify)
    assert any(path.endswith(CPP_NAME) for _, path in fake_hub.requests)
    assert snapshot(tiny) == before
    # HF_HOME decided where huggingface_hub cached what it got
    assert list((tmp_path / "cli-hf-home" / "hub").glob("models--Qwen--Qwen-7B-Chat/blobs/*"))

    fake_hub.requests.clear()
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_HOME"] = str(tmp_path / "empty-hf-home")
    code, doc = _cli(tiny, env)
    assert code == 1
    (fetch,) = [f for f in doc["findings"] if f["id"] == "kernels.fetch"]
    assert "HF_HUB_OFFLINE" in fetch["message"] and "--source vendored" in fetch["fix"]
    assert fake_hub.requests == []
    assert snapshot(tiny) == before
