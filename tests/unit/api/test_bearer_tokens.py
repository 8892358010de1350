"""The token file's format and the one check of a call's authorization values
(cadence.api.security), shared by both gRPC paths and the HTTP front."""

from __future__ import annotations

from cadence.api.security import BearerTokens, TokenRefusal, parse_tokens
from cadence.config import ServerConfig
from cadence.credentials import ClientCredentials


def test_blank_lines_and_comment_lines_are_no_tokens() -> None:
    text = "# the team's tokens\n\n  alpha  \n   # rotated out: beta\nbeta#gamma\n"
    assert parse_tokens(text) == ["alpha", "beta#gamma"]  # a '#' inside a token is the token's


def test_the_client_reads_the_same_format(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# mine\nalpha\n")
    assert ClientCredentials.from_files(token_file=str(path)).token == "alpha"


def test_one_value_naming_a_token_passes_and_several_are_refused() -> None:
    tokens = BearerTokens(["alpha"])
    assert tokens.check(["Bearer alpha"]) is None
    assert tokens.check([b"Bearer alpha"]) is None
    assert tokens.check([]) is TokenRefusal.MISSING
    assert tokens.check(["Basic alpha"]) is TokenRefusal.MALFORMED
    assert tokens.check(["Bearer beta"]) is TokenRefusal.WRONG
    assert tokens.check(["Bearer alpha", "Bearer beta"]) is TokenRefusal.SEVERAL
    assert tokens.check(["Bearer beta", "Bearer alpha"]) is TokenRefusal.SEVERAL
    # Envoy hands a repeated header over joined with commas.
    assert tokens.check(["Bearer alpha,Bearer beta"]) is TokenRefusal.SEVERAL


def test_a_file_of_comments_only_or_a_token_with_a_comma_is_refused_at_start(tmp_path) -> None:
    from cadence.api.security import problems

    path = tmp_path / "tokens"
    path.write_text("# nothing yet\n")
    assert problems(ServerConfig(auth_token_file=str(path))) == [
        (f"--auth-token-file {path} holds no token (one per line; blank and # lines are skipped)")
    ]
    path.write_text("a,b\n")
    assert "holds a ','" in problems(ServerConfig(auth_token_file=str(path)))[0]
