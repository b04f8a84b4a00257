"""The services' refusals a person reads (the tabs' toasts, the REST API's errors), as keyed messages.

The English is what the services always said; ``studio/messages/zh_services.py`` holds the Chinese by key.
A refusal names its object with a ``Word`` (``what``: run, dataset, ...) so one text serves every kind.
"""

from __future__ import annotations

from engine.messages import Catalog, Message, Word

SERVICES = Catalog(
    "services",
    {
        # a refusal about one field of a request: the field, then the message itself
        "at_field": "{field}: {problem}",
        # a refusal heading its problems, one per line (the problems stay a list in ``details``)
        "with_problems": "{head}\n{problems}",
        # templates (studio.services.templates) and recipes (studio.services.recipes)
        "template_name_empty": "name: empty; give the template a name (up to {n} characters)",
        "template_name_long": "name: {n} characters; a template's name has at most {max}",
        "template_name_unprintable": "name: holds a control or invisible format character; use printable text",
        "template_name_taken": "name: a template named {name!r} exists; pick another name or delete that one first",
        "template_name_taken_now": "name: a template named {name!r} exists; pick another name",
        "templates_full": "the studio keeps at most {n} templates; delete some first",
        "template_not_found": "template {id} not found; GET /api/v1/templates lists them",
        "template_unusable": (
            "template {id} ({name!r}) no longer makes a run spec: {problem}; delete it and save the form again"
        ),
        "template_refused": "spec: a run of this template would be refused:",
        "recipe_not_found": "recipe: no recipe is named {name!r}; the recipes are {names}",
        # rows by id, and what their state allows (runs, evals, sweeps, exports, deployments, datasets)
        "not_found": "{what} {id} does not exist",
        "nothing_to_cancel": "{what} {id} already ended ({status}); nothing to cancel",
        "not_resumable": "{what} {id} is {status}; only failed or cancelled {what}s can be resumed",
        "running_cancel_first": "{what} {id} is running; cancel it first",
        "not_succeeded": "{what} {id} is {status}; {verb} it once it has succeeded",
        "deployment_active": "deployment {id} is {status}; stop it first",
        "deployment_not_running": "deployment {id} is {status}; chat once it is running",
        "deployment_no_answer": "deployment {id} did not answer at {url}: {error}",
        "dataset_in_use": "dataset {id} is used by queued or running run(s) {runs}; cancel them first",
        "dataset_kind": "{field}: dataset {id} ({name}) holds {kind} records; stage {stage} needs {want} data",
        "file_empty": "file: {name} is empty",
        "media_fetching": (
            "dataset {id}: its images named by URL are still being fetched ({done}/{total}); ask for "
            "statistics once the fetch has finished"
        ),
        "upload_too_large": (
            "file: {name} is larger than the upload limit of {mb} MB; split it or raise ERNIE_STUDIO_MAX_UPLOAD_MB"
        ),
        # the Train tab's YAML import (studio.services.config_import); ``where`` is the source and line
        "import_too_large": (
            "{where}: {size:,} bytes; a config to import may hold at most {limit:,} bytes (ERNIEKit's configs "
            "are a few KB)"
        ),
        "import_not_utf8": "{where}: not UTF-8 text (byte {byte}); save the file as UTF-8",
        "import_empty": "{where}: empty; paste an ERNIEKit training config (key: value lines)",
        "import_documents": "{where}: a second YAML document (after ---); import one config, one document",
        "import_anchors": (
            "{where}: YAML anchors and aliases (&name, *name) are not accepted in an imported config; write "
            "each value out"
        ),
        "import_tag": "{where}: YAML tag {tag!r} is not accepted in an imported config; write plain values",
        "import_nested": (
            "{where}: nested {depth} levels deep; a config is key: value lines (a value may be a list), at "
            "most {limit} levels"
        ),
        "import_not_yaml": "{where}: not valid YAML: {problem}",
        "import_probs": "{where}: train_dataset_prob: {value!r} is not numbers separated by commas",
        # PaddleOCR-VL: the stage against the base model's family (studio.services.run_spec)
        "ocr_stage_needs_ocr_model": (
            "stage: {stage} fine-tunes PaddleOCR-VL models, and base_model {model!r} is not one; pick a "
            "PaddleOCR-VL model (such as the tiny-ocr-vl preset) or another stage"
        ),
        "ocr_model_needs_ocr_stage": (
            "stage: base_model {model!r} is a PaddleOCR-VL model, which trains with stage {ocr_stage} (its "
            "prompt form and image processor), not {stage}"
        ),
    },
)


def at_field(field: str | None, problem: Message) -> Message:
    """``problem`` as a refusal of the request's ``field`` ("<field>: <problem>"), or as it is without one."""
    return SERVICES("at_field", field=field, problem=problem) if field else problem


def not_succeeded(what: str, row_id: int, status: str, verb: str, field: str | None = None) -> Message:
    """ "<what> <id> is <status>; <verb> it once it has succeeded" (a run or export asked for too early)."""
    problem = SERVICES("not_succeeded", what=Word(what), id=row_id, status=str(status), verb=Word(verb))
    return at_field(field, problem)
