// The console works without JavaScript; this only adds "select all" checkboxes.
document.addEventListener("change", (event) => {
  const box = event.target;
  if (!box.classList || !box.classList.contains("select-all")) return;
  const table = box.closest("table");
  for (const other of table.querySelectorAll("input[type=checkbox]")) other.checked = box.checked;
});
