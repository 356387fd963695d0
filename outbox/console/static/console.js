// The console works without JavaScript. This adds "select all" checkboxes and the
// auto-refresh: every few seconds (the body's data-refresh-seconds) the page asks the
// console for its main part again (?fragment=1) and swaps in each part marked data-live,
// except one the operator is working in (a ticked box, the focus). One click turns it off;
// the choice is kept (localStorage).
document.addEventListener("change", (event) => {
  const box = event.target;
  if (!box.classList || !box.classList.contains("select-all")) return;
  const table = box.closest("table");
  for (const other of table.querySelectorAll("input[type=checkbox]")) other.checked = box.checked;
});

(() => {
  const body = document.body;
  const toggle = document.getElementById("refresh-toggle");
  const status = document.getElementById("refresh-status");
  const every = Number(body.dataset.refreshSeconds || 0) * 1000;
  if (!toggle || !status || body.dataset.live !== "1" || !(every > 0)) return;
  const KEY = "outbox-console-refresh";
  let on = localStorage.getItem(KEY) !== "off";
  let timer = null;

  const show = () => {
    toggle.textContent = on ? `Auto-refresh: on (every ${every / 1000} s)` : "Auto-refresh: off";
    toggle.setAttribute("aria-pressed", String(on));
  };
  const busy = (part) =>
    part.querySelector("input[type=checkbox]:checked") !== null ||
    (document.activeElement !== document.body && part.contains(document.activeElement));
  const schedule = () => {
    clearTimeout(timer);
    if (on) timer = setTimeout(refresh, every);
  };

  async function refresh() {
    const url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    try {
      const response = await fetch(url, { credentials: "same-origin" });
      if (response.redirected) {
        // The session ended (logged out elsewhere, expired): say so, stop refreshing.
        on = false;
        show();
        status.textContent = "session ended: reload the page to log in";
        return;
      }
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      if (!response.ok) {
        const why = page.querySelector("p.error");
        status.textContent = `refresh failed (${response.status}${why ? ": " + why.textContent : ""})`;
        return;
      }
      for (const fresh of page.querySelectorAll("[data-live]")) {
        const current = fresh.id && document.getElementById(fresh.id);
        if (current && !busy(current)) current.replaceWith(document.adoptNode(fresh));
      }
      status.textContent = "updated " + new Date().toISOString().slice(11, 19) + " UTC";
    } catch (error) {
      status.textContent = "refresh failed: the console did not answer";
    } finally {
      schedule();
    }
  }

  toggle.hidden = false;
  toggle.addEventListener("click", () => {
    on = !on;
    localStorage.setItem(KEY, on ? "on" : "off");
    show();
    if (on) refresh();
    else clearTimeout(timer);
  });
  show();
  schedule();
})();
