"""The playground page: static files only (service/api/static/playground), served at /ui, open like /readyz.

The page holds no data: everything it shows comes from the /v1 API, called from the browser with the key the
user types (kept in that tab's session storage), so authentication stays where it is, on /v1.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[1] / "static" / "playground"
# Scripts, styles and requests only from this origin; the page can't be framed, nothing is sent elsewhere.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@router.get("/ui")
async def playground() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui")


def install_playground(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="playground-static")
