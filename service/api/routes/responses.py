"""Placeholder: the responses API's routes are being written (issue 40)."""

from fastapi import APIRouter

router = APIRouter(prefix="/v1")
