// loraplex admin, Playground: streams the base model's and the adapter's answers side by side.
// Without this file the form posts and the page comes back with both answers, whole.
//
// On submit it sends the form (with its CSRF token) twice to form[data-stream-src], once with
// side=base and once with side=adapter, reads each response as server-sent events and appends
// the text as it arrives. Events: "start" {model}, unnamed {text}, "done" {finish,
// completion_tokens, seconds}, "error" {message}. Text is only ever set as text, never as HTML.
"use strict";

(function () {
  var form = document.querySelector("form[data-playground]");
  if (!form || !window.fetch || !window.TextDecoder || !window.AbortController) return;
  if (!window.ReadableStream || !("body" in Response.prototype)) return;

  var url = form.getAttribute("data-stream-src");
  var baseModel = form.getAttribute("data-base-model");
  var answers = document.querySelector("[data-answers]");
  var runButton = form.querySelector("[data-run]");
  var stopButton = form.querySelector("[data-stop]");
  var hint = form.querySelector("[data-run-hint]");
  var running = null; // the AbortController of the runs in progress

  if (hint) hint.hidden = false;

  function column(side) {
    return answers.querySelector('[data-side="' + side + '"]');
  }

  function setMeta(col, text, isError) {
    var meta = col.querySelector("[data-meta]");
    meta.textContent = text;
    meta.classList.toggle("field-error", !!isError);
    meta.classList.toggle("muted", !isError);
    if (isError) meta.setAttribute("role", "alert");
    else meta.removeAttribute("role");
  }

  function plural(n, word) {
    return n + " " + word + (n === 1 ? "" : "s");
  }

  // Parse one SSE block ("event: x\ndata: {...}") into [name, data].
  function parseEvent(block) {
    var name = "message";
    var data = [];
    block.split("\n").forEach(function (line) {
      if (line.indexOf("event:") === 0) name = line.slice(6).trim();
      else if (line.indexOf("data:") === 0) data.push(line.slice(5).replace(/^ /, ""));
    });
    return [name, data.length ? JSON.parse(data.join("\n")) : null];
  }

  // A 400 about one of the form's fields (the JSON schema box) is shown under that field too,
  // as the page without scripts shows it; the field's hint comes back on the next run.
  function showFieldError(name, message) {
    var input = form.querySelector("#f-" + name);
    var box = input && input.closest(".field");
    if (!box) return;
    var help = box.querySelector(".field-error, .field-hint");
    if (!help) {
      help = document.createElement("p");
      help.id = "f-" + name + "-help";
      box.appendChild(help);
    }
    if (!help.hasAttribute("data-hint") && help.classList.contains("field-hint")) {
      help.setAttribute("data-hint", help.textContent);
    }
    help.className = "field-error";
    help.textContent = message;
    box.classList.add("has-error");
    input.setAttribute("aria-invalid", "true");
  }

  function clearFieldError(name) {
    var input = form.querySelector("#f-" + name);
    var box = input && input.closest(".field");
    if (!box || !box.classList.contains("has-error")) return;
    var help = box.querySelector(".field-error");
    if (help && help.hasAttribute("data-hint")) {
      help.className = "field-hint";
      help.textContent = help.getAttribute("data-hint");
    }
    box.classList.remove("has-error");
    input.removeAttribute("aria-invalid");
  }

  function failureMessage(response) {
    return response.text().then(function (text) {
      try {
        var body = JSON.parse(text);
        if (body && body.error && body.error.message) {
          if (body.error.param === "schema") showFieldError("schema", body.error.message);
          return body.error.message;
        }
      } catch (e) { /* not JSON: an HTML page */ }
      if (response.status === 403) {
        return "The request was refused: your session may have ended. Reload the page and sign in again.";
      }
      return "The server answered HTTP " + response.status + ".";
    });
  }

  function runSide(side, signal) {
    var col = column(side);
    var text = col.querySelector("[data-text]");
    var started = Date.now();
    text.textContent = "";
    col.querySelector("[data-model]").textContent = "";
    col.setAttribute("aria-busy", "true");
    col.classList.add("is-running");
    setMeta(col, "Waiting for the first token…", false);

    var body = new URLSearchParams(new FormData(form));
    body.set("side", side);
    var done = false;

    function handle(name, data) {
      if (name === "start") {
        col.querySelector("[data-model]").textContent = data.model;
        setMeta(col, "Generating…", false);
      } else if (name === "message") {
        text.append(data.text);
      } else if (name === "done") {
        done = true;
        setMeta(col, plural(data.completion_tokens, "token") + " · " + data.seconds.toFixed(2) +
          " s · " + data.finish, false);
      } else if (name === "error") {
        done = true;
        setMeta(col, data.message, true);
      }
    }

    return fetch(url, {
      method: "POST",
      body: body,
      credentials: "same-origin",
      cache: "no-store",
      headers: { Accept: "text/event-stream" },
      signal: signal,
    })
      .then(function (response) {
        if (!response.ok) {
          return failureMessage(response).then(function (message) {
            done = true;
            setMeta(col, message, true);
          });
        }
        var reader = response.body.getReader();
        var decoder = new TextDecoder();
        var buffer = "";
        function pump() {
          return reader.read().then(function (chunk) {
            if (chunk.done) return;
            buffer += decoder.decode(chunk.value, { stream: true });
            var blocks = buffer.split("\n\n");
            buffer = blocks.pop();
            blocks.forEach(function (block) {
              if (block.trim()) handle.apply(null, parseEvent(block));
            });
            return pump();
          });
        }
        return pump();
      })
      .catch(function (error) {
        done = true;
        if (error && error.name === "AbortError") {
          setMeta(col, "Stopped after " + ((Date.now() - started) / 1000).toFixed(1) + " s.", false);
        } else {
          setMeta(col, "The connection failed: " + (error && error.message ? error.message : error), true);
        }
      })
      .finally(function () {
        if (!done) setMeta(col, "The stream ended early; try again.", true);
        col.removeAttribute("aria-busy");
        col.classList.remove("is-running");
      });
  }

  function setRunning(on) {
    runButton.disabled = on;
    runButton.textContent = on ? "Running…" : "Run";
    stopButton.hidden = !on;
  }

  form.addEventListener("submit", function (event) {
    if (!form.checkValidity()) return; // let the browser point at the field
    event.preventDefault();
    if (running) running.abort();
    var controller = new AbortController();
    running = controller;
    var model = form.elements.model ? form.elements.model.value : baseModel;
    var sides = model && model !== baseModel ? ["base", "adapter"] : ["base"];
    clearFieldError("schema");
    answers.hidden = false;
    column("adapter").hidden = sides.length < 2;
    column("base").hidden = false;
    setRunning(true);
    Promise.all(sides.map(function (side) { return runSide(side, controller.signal); }))
      .finally(function () {
        if (running === controller) {
          running = null;
          setRunning(false);
        }
      });
  });

  stopButton.addEventListener("click", function () {
    if (running) running.abort();
  });

  form.addEventListener("keydown", function (event) {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && !runButton.disabled) {
      event.preventDefault();
      if (form.requestSubmit) form.requestSubmit(runButton);
      else runButton.click();
    }
  });
})();
