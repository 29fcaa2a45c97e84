"""The dashboard: `GET /` serves one static page (no token needed for the page itself); its
scripts read the API with the token the user enters, kept in the browser's sessionStorage.

Plain HTML, JavaScript and CSS under service/api/static/, no build step; the chart library (uPlot)
is vendored under service/api/static/vendor/ by scripts/vendor_charts.sh. Everything is served by
this process, so the dashboard works offline.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
STATIC_PATH = "/static"

# The page loads only its own files and talks only to this origin; data is inserted as text,
# never as markup, so no inline script or style is needed either.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'"
)

router = APIRouter(include_in_schema=False)


@router.get("/")
def dashboard() -> FileResponse:
    return FileResponse(
        STATIC_DIR / "index.html",
        headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "Cache-Control": "no-cache",
            "Referrer-Policy": "no-referrer",
        },
    )


def static_files() -> StaticFiles:
    """The page's scripts, styles and the vendored chart library, at STATIC_PATH."""
    return StaticFiles(directory=STATIC_DIR)
