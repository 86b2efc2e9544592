"""Request and response bodies, one module per API. Pydantic validates shape; the stages validate meaning.
service/api/params.py maps every request into the pipeline's parameters, in one place."""
