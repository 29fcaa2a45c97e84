"""`DocumentedAs`: a field validated as one type and published in JSON Schema (and so in the
OpenAPI document) as another, for values the service must receive raw to report every problem
at once with its JSON path (a workflow document), or stores and answers as they were written
(a job's request and result)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, GetJsonSchemaHandler, TypeAdapter
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema


@dataclass(frozen=True)
class DocumentedAs:
    """`Annotated[dict[str, Any], DocumentedAs(Workflow)]`: validated as a dict, described as a
    `$ref` to Workflow's schema, which joins the document's definitions (`$defs`, or the
    OpenAPI components) under its own name."""

    shape: Any  # a model, or any type pydantic can describe (a union of models)

    def __get_pydantic_json_schema__(
        self, _schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        core = (
            self.shape.__pydantic_core_schema__
            if isinstance(self.shape, type) and issubclass(self.shape, BaseModel)
            else TypeAdapter(self.shape).core_schema
        )
        # The generator itself, not `handler(core)`: only its entry point turns a model into a
        # `$ref` and a definition; the handler's inner step would copy the model inline.
        generator = handler.generate_json_schema  # type: ignore[attr-defined]
        schema: JsonSchemaValue = generator.generate_inner(core)
        return schema
