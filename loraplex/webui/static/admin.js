// loraplex admin: progressive enhancement only. Every page works without this file; with it,
// live numbers refresh in place and copy buttons appear. No inline scripts (the pages' CSP
// allows only this file), no third-party code.
//
// Markup it looks for:
//   [data-live-src][data-live-interval]   poll a JSON endpoint {engine: {up, error, display, kv_usage}}
//     [data-live=KEY]                     text replaced by engine.display[KEY]
//     [data-live-meter=KEY]               <meter> whose value becomes engine[KEY]
//     [data-live-down] / [data-live-error] the "engine down" banner and its reason
//     [data-live-updated]                 "Updated 12:00:03" / "Connection lost"
//   [data-fragment-src][data-fragment-interval]  poll an HTML fragment and swap it in
//   button[data-copy=ID]                  copy the text of #ID (or its value) to the clipboard
"use strict";

(function () {
  function every(ms, fn) {
    // Poll while the tab is visible; one request at a time; catch up on becoming visible.
    var busy = false;
    function tick() {
      if (busy || document.hidden) return;
      busy = true;
      Promise.resolve(fn()).finally(function () { busy = false; });
    }
    setInterval(tick, ms);
    document.addEventListener("visibilitychange", function () { if (!document.hidden) tick(); });
  }

  function fetchOk(url, accept) {
    return fetch(url, {
      credentials: "same-origin",
      cache: "no-store",
      headers: { Accept: accept },
    }).then(function (response) {
      if (response.status === 401) throw new Error("signed-out");
      if (!response.ok) throw new Error("HTTP " + response.status);
      return response;
    });
  }

  function setUpdated(root, text, isError) {
    var el = root.querySelector("[data-live-updated]");
    if (!el) return;
    el.textContent = text;
    el.classList.toggle("field-error", !!isError);
  }

  function applyEngine(root, engine) {
    root.classList.toggle("is-up", engine.up);
    root.classList.toggle("is-down", !engine.up);
    root.querySelectorAll("[data-live]").forEach(function (el) {
      var value = engine.display[el.getAttribute("data-live")];
      if (value !== undefined && el.textContent !== value) el.textContent = value;
    });
    root.querySelectorAll("[data-live-meter]").forEach(function (el) {
      var value = engine[el.getAttribute("data-live-meter")];
      el.value = typeof value === "number" ? value : 0;
    });
    var banner = root.querySelector("[data-live-down]");
    if (banner) banner.hidden = engine.up;
    var reason = root.querySelector("[data-live-error]");
    if (reason) reason.textContent = engine.error || "";
  }

  function live(root) {
    var url = root.getAttribute("data-live-src");
    var ms = parseInt(root.getAttribute("data-live-interval"), 10) || 2000;
    var stopped = false;
    every(ms, function () {
      if (stopped) return null;
      return fetchOk(url, "application/json")
        .then(function (response) { return response.json(); })
        .then(function (data) {
          applyEngine(root, data.engine);
          setUpdated(root, "Updated " + new Date().toLocaleTimeString(), false);
        })
        .catch(function (error) {
          if (error.message === "signed-out") {
            stopped = true;
            setUpdated(root, "Signed out: reload the page to sign in again.", true);
          } else {
            setUpdated(root, "Connection lost; retrying…", true);
          }
        });
    });
  }

  function fragment(root) {
    var url = root.getAttribute("data-fragment-src");
    var ms = parseInt(root.getAttribute("data-fragment-interval"), 10) || 10000;
    every(ms, function () {
      return fetchOk(url, "text/html")
        .then(function (response) { return response.text(); })
        .then(function (html) { root.innerHTML = html; })  // same-origin, server-escaped markup
        .catch(function () { /* keep the last charts; the live numbers report the outage */ });
    });
  }

  function copyButton(button) {
    var target = document.getElementById(button.getAttribute("data-copy"));
    if (!target || !navigator.clipboard) return;  // stays hidden: select and copy by hand
    button.hidden = false;
    var label = button.textContent;
    button.addEventListener("click", function () {
      var text = "value" in target ? target.value : target.textContent;
      navigator.clipboard.writeText(text.trim()).then(function () {
        button.textContent = "Copied";
        button.classList.add("copied");
        setTimeout(function () {
          button.textContent = label;
          button.classList.remove("copied");
        }, 1500);
      });
    });
  }

  function start() {
    document.querySelectorAll("[data-live-src]").forEach(live);
    document.querySelectorAll("[data-fragment-src]").forEach(fragment);
    document.querySelectorAll("button[data-copy]").forEach(copyButton);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
